// The tensor wire (proto/tensor_wire): sealing, and two ports moving sealed
// messages both ways, with what a stranger or a slow peer may do.
#include "moe/tensor_wire/tensor_port.h"

#include <gtest/gtest.h>

#include <numeric>
#include <thread>

#include "moe/base/check.h"

namespace moe::tensor_wire {
namespace {

using Clock = TensorPort::Clock;
using namespace std::chrono_literals;

std::string bytes_of(size_t n, int seed) {
  std::string s(n, '\0');
  for (size_t i = 0; i < n; ++i) s[i] = static_cast<char>((i * 131 + seed * 7) & 0xff);
  return s;
}

TEST(Seal, OpensOnlyUnderItsKeyAndTagAndUnaltered) {
  const Key key = new_key(), other = new_key();
  const std::string plain = bytes_of(1000, 1);
  const uint64_t tag = make_tag(Direction::kToNode, 5, 9);
  std::string m = seal(key, tag, plain.data(), plain.size());
  ASSERT_EQ(m.size(), plain.size() + kSealBytes);
  EXPECT_EQ(m.substr(0, plain.size()), plain);  // authenticated, not encrypted
  std::string copy = m;
  ASSERT_TRUE(open(key, tag, copy));
  EXPECT_EQ(copy, plain);
  copy = m;
  EXPECT_FALSE(open(other, tag, copy));
  copy = m;
  EXPECT_FALSE(open(key, make_tag(Direction::kToNode, 5, 10), copy));  // another message's tag
  copy = m;
  EXPECT_FALSE(open(key, make_tag(Direction::kToClient, 5, 9), copy));  // the other direction
  copy = m;
  copy[500] ^= 1;
  EXPECT_FALSE(open(key, tag, copy));
  copy = m.substr(0, 10);
  EXPECT_FALSE(open(key, tag, copy));
  std::string empty = seal(key, tag, nullptr, 0);  // an empty message still carries its seal
  ASSERT_TRUE(open(key, tag, empty));
  EXPECT_TRUE(empty.empty());
}

TEST(Seal, TagsKeepTheirFields) {
  const uint64_t t = make_tag(Direction::kToClient, kMaxPeerId, 0xfffffffe);
  EXPECT_EQ(t >> 56, 2u);
  EXPECT_EQ((t >> 32) & kMaxPeerId, kMaxPeerId);
  EXPECT_EQ(t & 0xffffffffu, 0xfffffffeu);
}

// A node's port and a client's, each the other's peer under one key.
struct Pair {
  TensorPort node{PortOptions{Direction::kToNode, true, 300ms}};
  TensorPort client{PortOptions{Direction::kToClient, true, 300ms}};
  Key key = new_key();
  uint32_t node_id_for_client = node.add_peer(client.address(), key, 1 << 20, 4 << 20);
  uint32_t client_id_for_node = client.add_peer(node.address(), key, 1 << 20, 4 << 20);
  uint64_t to_node(uint32_t seq) const { return make_tag(Direction::kToNode, node_id_for_client, seq); }
  uint64_t to_client(uint32_t seq) const { return make_tag(Direction::kToClient, client_id_for_node, seq); }
};

// Waits (bounded) until the port has dropped `n` messages.
bool dropped_reaches(const TensorPort& port, uint64_t n) {
  for (auto until = Clock::now() + 5s; Clock::now() < until; std::this_thread::sleep_for(5ms))
    if (port.dropped() >= n) return true;
  return false;
}

TEST(TensorPort, MovesMessagesBothWaysWhetherExpectedBeforeOrAfter) {
  Pair p;
  uint32_t seq = 1;
  for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{100000}, size_t{1} << 20}) {
    const std::string x = bytes_of(n, static_cast<int>(seq));
    p.client.send_and_wait(p.client_id_for_node, p.to_node(seq), x.data(), x.size(), Clock::now() + 10s);
    EXPECT_EQ(p.node.take(p.node_id_for_client, p.to_node(seq), n, Clock::now() + 10s), x) << n;
    // The reply expected before it is sent.
    const std::string y = bytes_of(n, 100 + static_cast<int>(seq));
    std::string got;
    std::thread taker([&] { got = p.client.take(p.client_id_for_node, p.to_client(seq), n, Clock::now() + 10s); });
    std::this_thread::sleep_for(20ms);
    p.node.send_and_wait(p.node_id_for_client, p.to_client(seq), y.data(), y.size(), Clock::now() + 10s);
    taker.join();
    EXPECT_EQ(got, y) << n;
    ++seq;
  }
  EXPECT_EQ(p.node.dropped(), 0u);
  EXPECT_EQ(p.client.dropped(), 0u);
}

TEST(TensorPort, AStrangersMessagesAreDroppedAndThePeersStillArrive) {
  Pair p;
  TensorPort stranger{PortOptions{Direction::kToClient}};
  const uint32_t to_node = stranger.add_peer(p.node.address(), new_key(), 1 << 20, 1 << 20);
  const std::string fake = bytes_of(4096, 3), real = bytes_of(4096, 4);
  // Under the client's tag but another key: fails to open.
  stranger.send_and_wait(to_node, p.to_node(7), fake.data(), fake.size(), Clock::now() + 10s);
  ASSERT_TRUE(dropped_reaches(p.node, 1));
  // A peer id the node never gave, the wrong direction, and one over the peer's size limit.
  stranger.send_and_wait(to_node, make_tag(Direction::kToNode, p.node_id_for_client + 1000, 1), fake.data(),
                         fake.size(), Clock::now() + 10s);
  stranger.send_and_wait(to_node, make_tag(Direction::kToClient, p.node_id_for_client, 1), fake.data(), fake.size(),
                         Clock::now() + 10s);
  const std::string big((1 << 20) + 1, 'x');
  stranger.send_and_wait(to_node, p.to_node(8), big.data(), big.size(), Clock::now() + 10s);
  ASSERT_TRUE(dropped_reaches(p.node, 4));
  p.client.send_and_wait(p.client_id_for_node, p.to_node(7), real.data(), real.size(), Clock::now() + 10s);
  EXPECT_EQ(p.node.take(p.node_id_for_client, p.to_node(7), real.size(), Clock::now() + 10s), real);
  EXPECT_EQ(p.node.dropped(), 4u);
}

TEST(TensorPort, AMessageNobodyClaimsGoesAndOneThatNeverCameTimesOut) {
  Pair p;
  const std::string x = bytes_of(1000, 5);
  p.client.send_and_wait(p.client_id_for_node, p.to_node(1), x.data(), x.size(), Clock::now() + 10s);
  ASSERT_TRUE(dropped_reaches(p.node, 1));  // unclaimed for 300 ms
  try {
    p.node.take(p.node_id_for_client, p.to_node(1), x.size(), Clock::now() + 100ms);
    FAIL() << "a dropped message was handed out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("did not arrive in time"), std::string::npos) << e.what();
  }
  // The size the call said is checked.
  p.client.send_and_wait(p.client_id_for_node, p.to_node(2), x.data(), x.size(), Clock::now() + 10s);
  try {
    p.node.take(p.node_id_for_client, p.to_node(2), x.size() + 4, Clock::now() + 5s);
    FAIL() << "a message of the wrong size was handed out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1000 bytes, expected 1004"), std::string::npos) << e.what();
  }
}

TEST(TensorPort, APeerThatLeavesFailsItsExpectations) {
  Pair p;
  std::string error;
  std::thread taker([&] {
    try {
      p.node.take(p.node_id_for_client, p.to_node(1), 10, Clock::now() + 10s);
    } catch (const Error& e) {
      error = e.what();
    }
  });
  std::this_thread::sleep_for(50ms);
  p.node.remove_peer(p.node_id_for_client);
  taker.join();
  EXPECT_NE(error.find("left"), std::string::npos) << error;
  EXPECT_EQ(p.node.peers(), 0u);
  EXPECT_THROW(p.node.send_and_wait(p.node_id_for_client, p.to_client(1), "x", 1, Clock::now() + 1s), Error);
}

}  // namespace
}  // namespace moe::tensor_wire
