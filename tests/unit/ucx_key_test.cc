// The job key on the data plane (docs/transport.md#job-key): at wire-up every UCX
// peer proves it holds the job's key; a peer with another key, and a stranger that
// reached a rank's worker address before the real peer, are refused, naming the
// rank, before any tensor is read from them.
#include <gtest/gtest.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "moe/transport/bootstrap.h"
#include "moe/transport/ucx_communicator.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
using namespace moe::transport;

// An in-memory all-gather for R ranks; `release(r)` gates when rank r gets its answer.
class GatedBootstrap {
 public:
  explicit GatedBootstrap(int R) : blobs_(R), gated_(R, false) {}
  void gate(int r) { gated_[r] = true; }
  void release(int r) {
    std::lock_guard lock(mu_);
    gated_[r] = false;
    cv_.notify_all();
  }
  std::vector<std::string> all() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return count_ == static_cast<int>(blobs_.size()); });
    return blobs_;
  }
  struct Rank : Bootstrap {
    GatedBootstrap& b;
    int r;
    Rank(GatedBootstrap& b, int r) : b(b), r(r) {}
    std::vector<std::string> all_gather(const std::string& mine) override {
      std::unique_lock lock(b.mu_);
      b.blobs_[r] = mine;
      ++b.count_;
      b.cv_.notify_all();
      b.cv_.wait(lock, [&] { return b.count_ == static_cast<int>(b.blobs_.size()) && !b.gated_[r]; });
      return b.blobs_;
    }
  };

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> blobs_;
  std::vector<bool> gated_;
  int count_ = 0;
};

// Runs ranks 0 and 1 with the keys given, each then in a barrier; returns their errors.
std::vector<std::string> run_pair(GatedBootstrap& boot, const std::string& key0, const std::string& key1,
                                  const std::function<void()>& before_rank1 = {}) {
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        GatedBootstrap::Rank b(boot, r);
        UcxOptions o;
        o.job_key = r == 0 ? key0 : key1;
        o.connect_timeout = 10s;
        UcxCommunicator c(r, 2, b, o);
        c.barrier(deadline_in(5s));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  if (before_rank1) before_rank1();
  for (auto& t : threads) t.join();
  return errors;
}

const std::string kKey(32, 'k');

TEST(UcxJobKey, PeersWithTheSameKeyConnect) {
  GatedBootstrap boot(2);
  const auto errors = run_pair(boot, kKey, kKey);
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

TEST(UcxJobKey, APeerWithAnotherKeyIsRefusedNamingIt) {
  GatedBootstrap boot(2);
  const auto errors = run_pair(boot, kKey, std::string(32, 'x'));
  EXPECT_NE(errors[0].find("rank 1's address does not hold this job's key: refused"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0's address does not hold this job's key: refused"), std::string::npos) << errors[1];
}

// A UCX worker outside the job: connects to an address and sends bytes on a tag,
// always by rendezvous, so a send completes only once the receiver matched it.
struct Stranger {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  Stranger() {
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG;
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    EXPECT_EQ(ucp_config_modify(config, "RNDV_THRESH", "0"), UCS_OK);
    EXPECT_EQ(ucp_init(&params, config, &context), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    EXPECT_EQ(ucp_worker_create(context, &wp, &worker), UCS_OK);
  }
  ~Stranger() {
    if (ep) {
      ucp_request_param_t p{};
      void* r = ucp_ep_close_nbx(ep, &p);
      while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker);
      if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    }
    ucp_worker_destroy(worker);
    ucp_cleanup(context);
  }
  // Sends `bytes` to `address` on `tag` and waits until the receiver took them.
  void send(const std::string& address, const std::string& bytes, uint64_t tag) {
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(address.data());
    ASSERT_EQ(ucp_ep_create(worker, &ep_params, &ep), UCS_OK);
    ucp_request_param_t p{};
    void* r = ucp_tag_send_nbx(ep, bytes.data(), bytes.size(), tag, &p);
    while (UCS_PTR_IS_PTR(r) && ucp_request_check_status(r) == UCS_INPROGRESS) ucp_worker_progress(worker);
    if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);
    void* flush = ucp_ep_flush_nbx(ep, &p);
    while (UCS_PTR_IS_PTR(flush) && ucp_request_check_status(flush) == UCS_INPROGRESS) ucp_worker_progress(worker);
    if (UCS_PTR_IS_PTR(flush)) ucp_request_free(flush);
  }
};

TEST(UcxJobKey, AStrangerAtTheRightAddressIsRefusedBeforeAnyTensorIsRead) {
  GatedBootstrap boot(2);
  boot.gate(1);  // rank 1 connects only after the stranger spoke to rank 0
  const auto errors = run_pair(boot, kKey, kKey, [&] {
    const std::string rank0 = boot.all()[0];
    Stranger s;
    // Rank 1's wire-up message as the stranger can forge it: the right tag
    // (wire-up kind 1, sequence 0, source rank 1), 32 bytes, but no key.
    s.send(rank0, std::string(32, '\0'), uint64_t{1} << 56 | 1);
    // Rank 0 has taken the stranger's message (a rendezvous send completes once
    // the receiver matched it); only now may rank 1 speak: UCX does not order two
    // endpoints' messages.
    boot.release(1);
  });
  EXPECT_NE(errors[0].find("rank 1's address does not hold this job's key: refused before reading from it"),
            std::string::npos)
      << errors[0];
}

}  // namespace
}  // namespace moe::test
