// node::ServeQueue and make_serve_call (docs/serving.md): a call's rows handed
// out in order across takes and layers, completed by its last piece whichever
// rank returns it, failed once, and every queued call failed when the job ends.
#include <gtest/gtest.h>

#include <cmath>
#include <thread>

#include "moe/base/check.h"
#include "moe/node/serve_handles.h"
#include "moe/node/serve_queue.h"
#include "moe/node/serve_requests.h"
#include "moe/spec/job_spec.h"

namespace moe::test {
namespace {

using node::ServeCall;
using node::ServePiece;

std::shared_ptr<ServeCall> call_of(int layer, int64_t rows, std::vector<std::string>& log) {
  auto c = std::make_shared<ServeCall>();
  c->layer = layer;
  c->rows = rows;
  c->row_bytes = 1;
  c->x.assign(rows, 0);
  c->y.assign(rows, 0);
  c->queued = node::ServeClock::now();
  c->done = [&log, layer, rows](const std::string& error) {
    log.push_back("layer " + std::to_string(layer) + " rows " + std::to_string(rows) + ": " + (error.empty() ? "ok" : error));
  };
  return c;
}

TEST(ServeQueue, HandsOutRowsOldestFirstAndCompletesACallWithItsLastPiece) {
  std::vector<std::string> log;
  node::ServeQueue q(2);
  auto a = call_of(0, 5, log), b = call_of(0, 4, log), c = call_of(1, 3, log);
  EXPECT_EQ(q.push(a, 100), "");
  EXPECT_EQ(q.push(b, 100), "");
  EXPECT_EQ(q.push(c, 12), "");  // 5 + 4 + 3 rows: just fits
  EXPECT_EQ(q.push(call_of(1, 1, log), 12), "the node's queue is full (12 rows wait, at most 12): call again later");
  const std::vector<float> ages = q.ages(node::ServeClock::now() + std::chrono::milliseconds(5));
  ASSERT_EQ(ages.size(), 4u);  // a lane per layer and kind: layer 1's forward calls are lane 2
  EXPECT_GE(ages[0], 5.0f);
  EXPECT_EQ(ages[1], 0.0f);
  EXPECT_GE(ages[2], 5.0f);
  const std::vector<ServePiece> first = q.take(0, 7);  // all of a, 2 rows of b
  ASSERT_EQ(first.size(), 2u);
  EXPECT_EQ(first[0].call, a);
  EXPECT_EQ(first[0].n, 5);
  EXPECT_EQ(first[1].call, b);
  EXPECT_EQ(first[1].first, 0);
  EXPECT_EQ(first[1].n, 2);
  const std::vector<ServePiece> second = q.take(0, 7);  // b's other 2 rows
  ASSERT_EQ(second.size(), 1u);
  EXPECT_EQ(second[0].first, 2);
  EXPECT_EQ(second[0].n, 2);
  EXPECT_TRUE(q.take(0, 7).empty());
  const uint8_t ones[5] = {1, 1, 1, 1, 1}, twos[2] = {2, 2}, threes[2] = {3, 3};
  q.finish(second[0], threes);  // returned out of order: b is not whole yet
  EXPECT_TRUE(log.empty());
  q.finish(first[1], twos);
  q.finish(first[0], ones);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(log[0], "layer 0 rows 4: ok");
  EXPECT_EQ(log[1], "layer 0 rows 5: ok");
  EXPECT_EQ(b->y, std::string("\x02\x02\x03\x03"));
  q.close("job stopped");  // c was queued: it fails
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[2], "layer 1 rows 3: job stopped");
  EXPECT_EQ(q.push(call_of(1, 1, log), 100), "job stopped");  // after the close: refused
  EXPECT_EQ(log.size(), 3u);
  EXPECT_FALSE(q.wait_for_step(1, std::chrono::milliseconds(1)));
}

TEST(ServeQueue, AFailedPieceFailsItsCallOnceAndItsOtherPiecesAreDropped) {
  std::vector<std::string> log;
  node::ServeQueue q(1);
  auto a = call_of(0, 4, log);
  EXPECT_EQ(q.push(a, 100), "");
  const auto p1 = q.take(0, 2), p2 = q.take(0, 2);
  q.fail(p1[0], "rank 1: transport failed");
  q.fail(p2[0], "rank 0: also");
  const uint8_t rows[2] = {9, 9};
  q.finish(p2[0], rows);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_EQ(log[0], "layer 0 rows 4: rank 1: transport failed");
}

TEST(ServeQueue, AnAbandonedCallLeavesTheQueueAndItsPiecesInFlightAreDropped) {
  std::vector<std::string> log;
  node::ServeQueue q(1);
  auto a = call_of(0, 6, log), b = call_of(0, 2, log);
  EXPECT_EQ(q.push(a, 100), "");
  EXPECT_EQ(q.push(b, 100), "");
  const auto p = q.take(0, 2);  // 2 of a's rows in flight
  q.abandon(a);
  const auto next = q.take(0, 10);  // only b is left
  ASSERT_EQ(next.size(), 1u);
  EXPECT_EQ(next[0].call, b);
  const uint8_t rows[2] = {1, 1};
  q.finish(p[0], rows);
  q.finish(next[0], rows);
  ASSERT_EQ(log.size(), 1u);
  EXPECT_EQ(log[0], "layer 0 rows 2: ok");
}

// Elastic serving: a world that fails mid-step gives its pieces back; the next
// world computes exactly those rows, the oldest call's first, and each call
// completes once.
TEST(ServeQueue, PiecesOfAFailedWorldWaitAgainInTheirCallsOrder) {
  std::vector<std::string> log;
  node::ServeQueue q(1);
  auto a = call_of(0, 5, log), b = call_of(0, 3, log);
  EXPECT_EQ(q.push(a, 100), "");
  EXPECT_EQ(q.push(b, 100), "");
  const auto lost = q.take(0, 6);  // all of a (it leaves the lane), b's first row
  const auto kept = q.take(0, 1);  // b's second row, computed by a rank that finished
  ASSERT_EQ(lost.size(), 2u);
  EXPECT_EQ(q.queued(), 1);
  q.put_back(lost);
  EXPECT_EQ(q.queued(), 7);  // 5 of a, 1 + 1 of b
  const uint8_t done[1] = {7};
  q.finish(kept[0], done);
  const auto again = q.take(0, 3);  // a first: it came first
  ASSERT_EQ(again.size(), 1u);
  EXPECT_EQ(again[0].call, a);
  EXPECT_EQ(again[0].first, 0);
  EXPECT_EQ(again[0].n, 3);
  const auto rest = q.take(0, 10);  // a's last 2 rows, b's returned row 0, b's row 2
  ASSERT_EQ(rest.size(), 3u);
  EXPECT_EQ(rest[0].call, a);
  EXPECT_EQ(rest[0].first, 3);
  EXPECT_EQ(rest[1].call, b);
  EXPECT_EQ(rest[1].first, 0);
  EXPECT_EQ(rest[1].n, 1);
  EXPECT_EQ(rest[2].first, 2);
  EXPECT_TRUE(q.take(0, 10).empty());
  const uint8_t rows[5] = {1, 2, 3, 4, 5};
  for (const auto& p : again) q.finish(p, rows);
  for (const auto& p : rest) q.finish(p, rows + p.first);
  ASSERT_EQ(log.size(), 2u);
  EXPECT_EQ(a->y, std::string("\x01\x02\x03\x04\x05"));
  EXPECT_EQ(b->y, std::string("\x01\x07\x03"));
  // Given back after the job ended: the call fails with the reason instead of waiting forever.
  auto c = call_of(0, 2, log);
  EXPECT_EQ(q.push(c, 100), "");
  const auto orphan = q.take(0, 2);
  q.close("job stopped");
  q.put_back(orphan);
  ASSERT_EQ(log.size(), 3u);
  EXPECT_EQ(log[2], "layer 0 rows 2: job stopped");
}

TEST(ServeQueue, AWaitingRankVotesOnceItsOldestRowWaitedOrEnoughRowsOrItsRecentCallersWait) {
  std::vector<std::string> log;
  node::ServeQueue q(1);
  const auto t0 = node::ServeClock::now();
  EXPECT_TRUE(q.wait_for_step(4, std::chrono::milliseconds(20)));  // nothing queued: the whole wait
  EXPECT_GE(node::ServeClock::now() - t0, std::chrono::milliseconds(20));
  auto from = [&](const std::string& caller, int64_t rows) {
    auto c = call_of(0, rows, log);
    c->caller = caller;
    EXPECT_EQ(q.push(c, 100), "");
  };
  from("a", 1);  // one caller, and its call waits: at once
  const auto t1 = node::ServeClock::now();
  EXPECT_TRUE(q.wait_for_step(100, std::chrono::seconds(10)));
  EXPECT_LT(node::ServeClock::now() - t1, std::chrono::seconds(5));
  from("b", 1);  // a second caller: a and b both have a call waiting
  EXPECT_TRUE(q.wait_for_step(100, std::chrono::seconds(10)));
  EXPECT_LT(node::ServeClock::now() - t1, std::chrono::seconds(5));
  q.take(0, 2);
  from("a", 1);  // b has not come back yet: a's row waits max_wait
  const auto t2 = node::ServeClock::now();
  EXPECT_TRUE(q.wait_for_step(100, std::chrono::milliseconds(30)));
  EXPECT_GE(node::ServeClock::now() - t2, std::chrono::milliseconds(29));
  from("b", 1);  // both back: at once
  const auto t3 = node::ServeClock::now();
  EXPECT_TRUE(q.wait_for_step(100, std::chrono::seconds(10)));
  EXPECT_LT(node::ServeClock::now() - t3, std::chrono::seconds(5));
  q.take(0, 3);
  std::this_thread::sleep_for(node::ServeQueue::kRecentCaller + std::chrono::milliseconds(20));
  from("a", 1);  // b went quiet: a alone is waited for again
  const auto t4 = node::ServeClock::now();
  EXPECT_TRUE(q.wait_for_step(100, std::chrono::seconds(10)));
  EXPECT_LT(node::ServeClock::now() - t4, std::chrono::seconds(5));
}

v1::JobSpec serving_spec() {
  v1::JobSpec s;
  s.set_mode(v1::JobSpec::serve);
  s.set_experts(4);
  s.set_top_k(2);
  s.set_hidden(3);
  s.set_ffn_hidden(4);
  s.set_layers(2);
  s.set_tokens_per_rank(8);
  return spec::with_defaults(s);
}

std::string refusal(const v1::ServeForward& f) {
  const v1::JobSpec spec = serving_spec();
  try {
    node::make_serve_call(layer_spec::JobView(spec), f, 16);
  } catch (const moe::InvalidArgument& e) {
    return e.what();
  }
  return "";
}

TEST(ServeQueue, ACallIsCheckedAgainstTheJobNamingTheField) {
  v1::ServeForward f;
  f.set_layer(1);
  f.set_rows(2);
  f.set_hidden(3);
  f.set_dtype(v1::JobSpec::fp32);
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  f.set_x(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  EXPECT_EQ(refusal(f), "");
  v1::ServeForward g = f;
  g.set_layer(-1);
  EXPECT_EQ(refusal(g), "layer: the job serves layers 0-1, got -1");
  g = f;
  g.set_hidden(4);
  EXPECT_EQ(refusal(g), "hidden: the job's layers take 3 values a row, got 4");
  g = f;
  g.set_rows(17);
  EXPECT_EQ(refusal(g), "rows: must be in [1, 16] a call, got 17");
  g = f;
  g.set_rows(3);
  EXPECT_EQ(refusal(g), "x: 3 rows of 3 fp32 values are 36 bytes, got 24");
  x[4] = std::nanf("");
  g = f;
  g.set_x(std::string(reinterpret_cast<const char*>(x.data()), x.size() * 4));
  EXPECT_EQ(refusal(g), "x: row(s) 1 hold a value that is not finite");
  g = f;
  g.set_dtype(v1::JobSpec::bf16);
  EXPECT_EQ(refusal(g), "dtype: the job computes in fp32, got bf16");
}

TEST(ServeHandles, AHandleServesOneBackwardWithinItsBytesAndAge) {
  node::ServeHandles h(10, std::chrono::seconds(600));
  const uint64_t a = h.keep({0, std::vector<uint8_t>(4, 1), ""}), b = h.keep({1, std::vector<uint8_t>(4, 2), ""});
  EXPECT_EQ(h.bytes(), 8u);
  const uint64_t c = h.keep({0, std::vector<uint8_t>(4, 3), ""});  // 12 bytes > 10: a, the oldest, goes
  EXPECT_EQ(h.count(), 2u);
  try {
    h.take(a);
    ADD_FAILURE() << "a pushed-out handle was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("handle: " + std::to_string(a) + " is spent or expired"), std::string::npos);
  }
  node::ServeHandles::Kept kb = h.take(b);
  EXPECT_EQ(kb.layer, 1);
  EXPECT_EQ(kb.x, std::vector<uint8_t>(4, 2));
  EXPECT_THROW(h.take(b), InvalidArgument);  // spent
  h.put_back(b, std::move(kb));                // a refused backward: good again
  EXPECT_EQ(h.take(b).x, std::vector<uint8_t>(4, 2));
  try {
    h.take(c + 7);
    ADD_FAILURE() << "a handle never given was taken";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("was never given by this node"), std::string::npos);
  }
  node::ServeHandles young(100, std::chrono::seconds(0));
  const uint64_t d = young.keep({0, {1}, ""});
  std::this_thread::sleep_for(std::chrono::milliseconds(5));  // past a zero ttl
  EXPECT_THROW(young.take(d), InvalidArgument);
  EXPECT_EQ(young.bytes(), 0u);
}

// docs/serving.md#disconnects: a session's handles go with its last connection
// to the node; another session's stay.
TEST(ServeHandles, ASessionsHandlesGoWithItsLastConnection) {
  node::ServeHandles h(1000, std::chrono::seconds(600));
  EXPECT_TRUE(h.connected("s1", 1));
  EXPECT_FALSE(h.connected("s1", 1));  // known already: nobody registers twice
  EXPECT_TRUE(h.connected("s1", 2));
  EXPECT_TRUE(h.connected("s2", 3));
  const uint64_t mine = h.keep({0, {1, 2}, "s1"}), theirs = h.keep({0, {3}, "s2"}), anyone = h.keep({1, {4}, ""});
  EXPECT_EQ(h.disconnected("s1", 1), 0u);  // connection 2 is still open
  EXPECT_EQ(h.count(), 3u);
  EXPECT_EQ(h.disconnected("s1", 2), 1u);
  EXPECT_EQ(h.bytes(), 2u);
  EXPECT_THROW(h.take(mine), InvalidArgument);
  EXPECT_EQ(h.take(theirs).x, std::vector<uint8_t>{3});
  EXPECT_EQ(h.take(anyone).x, std::vector<uint8_t>{4});
  EXPECT_EQ(h.disconnected("s9", 4), 0u);  // a session never seen
}

TEST(ServeRequests, AStepIsDueOnceEveryCallerAskedAndAppliesOnce) {
  node::ServeRequests r;
  std::vector<std::string> log;
  auto note = [&log](const std::string& who) {
    return [&log, who](const std::string& error, int64_t steps, bool now) {
      log.push_back(who + " " + (error.empty() ? "ok" : error) + " " + std::to_string(steps) + (now ? " now" : ""));
    };
  };
  float v[node::ServeRequests::kVoteFloats];
  r.vote(v);
  EXPECT_FALSE(node::ServeRequests::step_due(v));
  r.ask_step(1, 2, "a", note("a"));
  r.ask_step(1, 2, "a", note("a again"));  // a retry counts once
  EXPECT_EQ(log, std::vector<std::string>{"a step 1: a asked again 0"});
  r.vote(v);
  EXPECT_FALSE(node::ServeRequests::step_due(v));
  EXPECT_THROW(r.ask_step(1, 3, "b", note("b")), InvalidArgument);  // callers disagree
  EXPECT_THROW(r.ask_step(3, 2, "b", note("b")), InvalidArgument);  // beyond the next step
  // Two nodes, one caller each: summed, the step is due.
  node::ServeRequests other;
  other.ask_step(1, 2, "b", note("b"));
  float w[node::ServeRequests::kVoteFloats];
  r.vote(v);
  other.vote(w);
  for (int i = 0; i < node::ServeRequests::kVoteFloats; ++i) v[i] += w[i];
  EXPECT_TRUE(node::ServeRequests::step_due(v));
  r.step_done("");
  EXPECT_EQ(log.back(), "a again ok 1 now");
  // Answered on one node, a's caller asks for step 2 on the other before that
  // node's ranks finished step 1: it waits for them, and is not refused.
  other.ask_step(2, 1, "a", note("a's next"));
  EXPECT_THROW(other.ask_step(4, 1, "a", note("far")), InvalidArgument);  // still beyond
  other.vote(w);
  EXPECT_EQ(w[0], 1.0f);  // b's, for step 1
  other.step_done("");
  EXPECT_EQ(log.back(), "b ok 1 now");
  other.vote(w);
  EXPECT_EQ(w[0], 1.0f);  // a's ask for step 2 now waits as any ask for the next step
  other.close("job stopped");
  EXPECT_EQ(log.back(), "a's next job stopped 0");
  r.ask_step(1, 2, "a", note("late"));  // already applied: answered at once
  EXPECT_EQ(log.back(), "late ok 1");
  r.ask_step(2, 1, "a", note("nothing"));
  r.step_done("step 2: nothing to apply");
  EXPECT_EQ(log.back(), "nothing step 2: nothing to apply 1");
  EXPECT_EQ(r.steps(), 1);
  r.ask_step(2, 1, "a", note("closed"));
  r.close("job stopped");
  EXPECT_EQ(log.back(), "closed job stopped 0");
  EXPECT_THROW(r.ask_step(2, 1, "a", note("after")), Error);
}

}  // namespace
}  // namespace moe::test
