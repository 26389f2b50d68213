// The daemon's side of the expert service (docs/serving.md): a program's calls
// of a serving job, checked and copied outside the daemon's lock, queued for
// the node's ranks, and answered on the io thread (without blocking it) once
// the ranks ran them, or with the error that stopped them.
#include <functional>
#include <optional>

#include "moe/base/check.h"
#include "moe/base/log.h"
#include "moe/node/daemon.h"
#include "serve_completion.h"

namespace moe::node {

using rpc::RpcError;

namespace {

// A rows call's lane from its fields (-1: a layer out of range, which counts nowhere).
int lane_of(const v1::Envelope& req) {
  const bool forward = req.has_serve_forward();
  const int layer = forward ? req.serve_forward().layer() : req.serve_backward().layer();
  if (layer < 0 || layer >= (1 << 20)) return -1;  // no overflow; the job's lanes are checked later
  return layer * kServeKinds + static_cast<int>(forward ? ServeKind::kForward : ServeKind::kBackward);
}

const std::string& job_of(const v1::Envelope& req) {
  if (req.has_serve_forward()) return req.serve_forward().job_id();
  if (req.has_serve_backward()) return req.serve_backward().job_id();
  if (req.has_serve_step()) return req.serve_step().job_id();
  if (req.has_serve_open_wire()) return req.serve_open_wire().job_id();
  return req.serve_weights().job_id();
}

}  // namespace

bool Daemon::is_serve_call(const v1::Envelope& req) {
  return req.has_serve_forward() || req.has_serve_backward() || req.has_serve_step() || req.has_serve_weights() ||
         req.has_serve_open_wire();
}

ServingNode* Daemon::serving_node_if(const std::string& job_id) {
  return runner_ && runner_->job_id() == job_id ? runner_->serving() : nullptr;
}

ServingNode& Daemon::serving_node(const std::string& job_id) {
  if (!runner_ || runner_->job_id() != job_id || runner_->finished())
    throw RpcError(v1::ERROR_CODE_NOT_FOUND, "job " + job_id + " is not running on " + opts_.name);
  if (!runner_->serving())
    throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, "job " + job_id + " is not a serving job (--mode serve)");
  return *runner_->serving();
}

rpc::awaitable<v1::Envelope> Daemon::serve_call(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  if (req.has_serve_step()) co_return co_await serve_step(req.serve_step(), ctx);
  if (req.has_serve_weights()) co_return co_await serve_weights(req.serve_weights(), ctx);
  if (req.has_serve_open_wire()) co_return co_await serve_open_wire(req.serve_open_wire(), ctx);
  co_return co_await serve_rows(req, ctx);
}

// A forward or backward call: its rows queued, the reply once every row is back;
// counted in the node's statistics as it ends, answered or not.
rpc::awaitable<v1::Envelope> Daemon::serve_rows(const v1::Envelope& req, const rpc::RequestContext& ctx) {
  const auto received = ServeClock::now();
  const std::string& job_id = job_of(req);
  int64_t answered_rows = -1;  // set when answered
  struct Count {               // runs as the call ends, however it ends
    std::function<void()> f;
    ~Count() { f(); }
  } count{[&] {
    const double seconds = std::chrono::duration<double>(ServeClock::now() - received).count();
    const int lane = lane_of(req);
    {
      std::lock_guard<std::mutex> lock(mu_);  // a lane the job has (no series for a stranger's layer numbers)
      ServingNode* node = serving_node_if(job_id);
      if (!node || lane < 0 || lane >= node->queue.lanes()) return;
      node->stats.record(lane, answered_rows, seconds, answered_rows >= 0, ctx.client_name);
    }
    if (metrics_)
      metrics_->record_serve_call(lane / kServeKinds, lane % kServeKinds == static_cast<int>(ServeKind::kBackward),
                                  answered_rows >= 0, answered_rows, seconds);
  }};
  const bool forward = req.has_serve_forward();
  const bool on_wire = is_wire_call(req);
  std::optional<v1::Envelope> filled;  // the call with its rows from the tensor wire
  if (on_wire) filled = co_await with_wire_rows(req, ctx);
  const v1::Envelope& call = on_wire ? *filled : req;
  v1::JobSpec spec;
  ServeLimits limits{};
  std::optional<ServeHandles::Kept> kept;  // a backward's rows
  {
    std::lock_guard<std::mutex> lock(mu_);
    ServingNode& node = serving_node(job_id);
    spec = runner_->spec();
    limits = node.limits;
    if (!forward) kept = node.handles.take(req.serve_backward().handle());
  }
  const layer_spec::JobView job(spec);
  std::shared_ptr<ServeCall> c;
  try {  // checked and copied without the lock (the io thread still waits for it)
    c = forward ? make_serve_call(job, call.serve_forward(), limits.call_rows)
                : make_serve_call(job, call.serve_backward(), kept->x, kept->layer);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);  // a refused backward leaves its handle good
    if (ServingNode* node = serving_node_if(job_id); kept && node)
      node->handles.put_back(req.serve_backward().handle(), std::move(*kept));
    throw;
  }
  kept.reset();
  c->caller = ctx.peer;
  auto done = std::make_shared<ServeCompletion>(io_);
  c->done = [done](const std::string& error) { done->end(error); };
  {
    std::lock_guard<std::mutex> lock(mu_);
    ServingNode& node = serving_node(job_id);
    if (const std::string refused = node.queue.push(c, limits.queued_rows); !refused.empty())
      throw RpcError(v1::ERROR_CODE_UNAVAILABLE, "job " + job_id + " on " + opts_.name + ": " + refused);
    watch_session(node, job_id, ctx);
  }
  auto gone = std::make_shared<bool>(false);  // the caller closed its connection: its rows leave the queue
  if (ctx.connection)
    ctx.connection->on_peer_gone([done, gone] {
      *gone = true;
      done->end("the caller closed its connection");
    });
  if (!co_await done->wait(ctx.deadline) || *gone) {  // nobody waits for its rows any more
    std::lock_guard<std::mutex> lock(mu_);
    if (ServingNode* node = serving_node_if(job_id)) node->queue.abandon(c);
    throw RpcError(*gone ? v1::ERROR_CODE_UNAVAILABLE : v1::ERROR_CODE_DEADLINE_EXCEEDED,
                   "job " + job_id + ": layer " + std::to_string(c->layer) + "'s rows " +
                       (*gone ? "were dropped: the caller closed its connection" : "were not computed in time"));
  }
  if (!done->error().empty()) throw RpcError(v1::ERROR_CODE_UNAVAILABLE, done->error());
  if (on_wire) co_await wire_answer(req, c->y, ctx);
  v1::Envelope reply;
  answered_rows = c->rows;
  if (!forward) {
    v1::ServeBackwardReply* r = reply.mutable_serve_backward_reply();
    r->set_rows(c->rows);
    if (on_wire)
      r->set_grad_x_on_wire(true);
    else
      r->set_grad_x(std::move(c->y));
    co_return reply;
  }
  v1::ServeForwardReply* r = reply.mutable_serve_forward_reply();
  r->set_rows(c->rows);
  if (on_wire)
    r->set_y_on_wire(true);
  else
    r->set_y(std::move(c->y));
  if (req.serve_forward().keep_for_backward()) {
    std::lock_guard<std::mutex> lock(mu_);
    r->set_handle(serving_node(job_id).handles.keep({c->layer, std::move(c->x), ctx.client_session}));
  }
  co_return reply;
}

// The session's handles live while it keeps a connection to this node: the
// first call on each connection says when that one closes.
void Daemon::watch_session(ServingNode& node, const std::string& job_id, const rpc::RequestContext& ctx) {
  if (!ctx.connection || ctx.client_session.empty() || !node.handles.connected(ctx.client_session, ctx.connection->id()))
    return;
  ctx.connection->on_close([this, job_id, session = ctx.client_session, id = ctx.connection->id()] {
    std::lock_guard<std::mutex> lock(mu_);
    ServingNode* n = serving_node_if(job_id);
    if (n)
      if (const size_t dropped = n->handles.disconnected(session, id); dropped > 0)
        log::info("job ", job_id, ": dropped ", dropped, " handle(s) of a client whose connections closed");
    if (!n || !n->handles.has_connections(session)) close_wire_peers(session);
  });
}

rpc::awaitable<v1::Envelope> Daemon::serve_step(const v1::ServeStep& call, const rpc::RequestContext& ctx) {
  auto done = std::make_shared<ServeCompletion>(io_);
  auto answer = std::make_shared<v1::ServeStepReply>();  // written before done->end posts
  {
    std::lock_guard<std::mutex> lock(mu_);
    ServingNode& node = serving_node(call.job_id());
    if (!layer_spec::JobView(runner_->spec()).train)
      throw InvalidArgument("step: job " + call.job_id() + " takes no optimizer steps (submit it with --serve-train)");
    node.requests.ask_step(call.step(), call.clients(), call.caller().empty() ? ctx.peer : call.caller(),
                           [done, answer](const std::string& error, int64_t steps, bool applied_now) {
                             answer->set_step(steps);
                             answer->set_applied_now(applied_now);
                             done->end(error);
                           });
  }
  if (!co_await done->wait(ctx.deadline))
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "job " + call.job_id() + ": step " + std::to_string(call.step()) +
                                                         " waits for " + std::to_string(call.clients()) +
                                                         " callers; ask again to go on waiting");
  if (!done->error().empty()) throw RpcError(v1::ERROR_CODE_FAILED_PRECONDITION, done->error());
  v1::Envelope reply;
  *reply.mutable_serve_step_reply() = *answer;
  co_return reply;
}

rpc::awaitable<v1::Envelope> Daemon::serve_weights(const v1::ServeWeights& call, const rpc::RequestContext& ctx) {
  auto done = std::make_shared<ServeCompletion>(io_);
  auto answer = std::make_shared<v1::ServeWeightsReply>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    serving_node(call.job_id()).requests.ask_weights([done, answer](const std::string& error, const v1::ServeWeightsReply& r) {
      *answer = r;
      done->end(error);
    });
  }
  if (!co_await done->wait(ctx.deadline))
    throw RpcError(v1::ERROR_CODE_DEADLINE_EXCEEDED, "job " + call.job_id() + ": the weights were not read in time");
  if (!done->error().empty()) throw RpcError(v1::ERROR_CODE_UNAVAILABLE, done->error());
  v1::Envelope reply;
  *reply.mutable_serve_weights_reply() = std::move(*answer);
  co_return reply;
}

}  // namespace moe::node
