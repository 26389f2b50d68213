// A backend whose memory the host cannot touch outside the backend's own calls,
// as on a GPU: the CPU backend underneath, but every allocation is a mapping of
// its own that stays PROT_NONE between calls. Code that reads or writes backend
// memory directly (which the CPU backend forgives) crashes under it. A
// communicator for the backend's memory (NCCL's role) opens it for its calls and
// refuses host memory, as NCCL does. The memory is open while any thread is
// inside a call (a rank's compute thread and its transfer thread may overlap).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>

#include "moe/kernels/api.h"
#include "moe/kernels/thread_pool.h"
#include "moe/transport/communicator.h"

namespace moe::test {

class GuardedBackend final : public kernels::Backend {
 public:
  explicit GuardedBackend(kernels::ThreadPool& pool);
  ~GuardedBackend() override;

  // While one lives, the memory is accessible (nested: the outermost closes it).
  class Open {
   public:
    explicit Open(GuardedBackend& g);
    ~Open();
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;

   private:
    GuardedBackend& g_;
  };
  int64_t calls() const { return calls_.load(); }
  // Whether [p, p + bytes) lies in one of this backend's allocations.
  bool holds(const void* p, size_t bytes) const;

  std::string name() const override { return "guarded-cpu"; }
  std::string gemm_engine() const override { return inner_->gemm_engine(); }
  std::string gemm_engine(kernels::DType d) const override { return inner_->gemm_engine(d); }
  void* alloc(size_t bytes) override;
  void free(void* p) override;
  void copy_to_device(void* dst, const void* src, size_t bytes) override;
  void copy_to_host(void* dst, const void* src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* p, size_t bytes) override;
  void synchronize() override {}
  void convert(const void* src, kernels::DType sd, void* dst, kernels::DType dd, int64_t n) override;
  void pack_rows(kernels::WireFormat f, const void* rows, kernels::DType dtype, int64_t n, int hidden,
                 void* wire) override;
  void unpack_rows(kernels::WireFormat f, const void* wire, int64_t n, int hidden, void* rows,
                   kernels::DType dtype) override;
  void add(void* dst, const void* src, kernels::DType dtype, int64_t n) override;
  std::unique_ptr<kernels::PackedWeights> make_router_weights(const kernels::RouterConfig& c) override;
  void pack_router_weights(kernels::PackedWeights& p, const float* w) override;
  std::unique_ptr<kernels::PackedWeights> make_expert_weights(const kernels::ExpertMlpConfig& c) override;
  void pack_expert_weights(kernels::PackedWeights& p, const float* w13, const float* w2, int first, int count) override;
  void update_expert_weights(const kernels::OptimizerConfig& c, const kernels::OptimizerArgs& w13,
                             const kernels::OptimizerArgs& w2, kernels::PackedWeights& p, int num_experts) override;
  size_t router_workspace_bytes(const kernels::RouterConfig& c) const override;
  void router_forward(const kernels::RouterConfig& c, const kernels::RouterForwardArgs& a) override;
  void router_backward(const kernels::RouterConfig& c, const kernels::RouterBackwardArgs& a) override;
  size_t capacity_workspace_bytes(const kernels::CapacityConfig& c) const override;
  void capacity_drop(const kernels::CapacityConfig& c, const kernels::CapacityArgs& a) override;
  void select_replicas(int64_t T, int K, int E, const kernels::ReplicaArgs& a) override;
  size_t dispatch_layout_workspace_bytes(const kernels::DispatchLayoutConfig& c) const override;
  void dispatch_layout(const kernels::DispatchLayoutConfig& c, const kernels::DispatchLayoutArgs& a) override;
  size_t permute_layout_workspace_bytes(const kernels::PermuteLayoutConfig& c) const override;
  void permute_layout(const kernels::PermuteLayoutConfig& c, const kernels::PermuteLayoutArgs& a) override;
  void permute(const kernels::PermuteConfig& c, const kernels::PermuteArgs& a) override;
  void unpermute(const kernels::UnpermuteConfig& c, const kernels::UnpermuteArgs& a) override;
  void unpermute_scalars(const int32_t* pos, int64_t n, int k, const float* perm, float* pair) override;
  void combine_pair_scalars(const int32_t* slot, const int32_t* send_row, int64_t T, int K, int R, int S,
                            const float* rows, float* pair) override;
  void swiglu_forward(const kernels::SwigluConfig& c, const kernels::SwigluForwardArgs& a) override;
  void swiglu_backward(const kernels::SwigluConfig& c, const kernels::SwigluBackwardArgs& a) override;
  void grouped_gemm(const kernels::GroupedGemmConfig& c, const kernels::GroupedGemmArgs& a) override;
  void optimizer_step(const kernels::OptimizerConfig& c, const kernels::OptimizerArgs& a) override;
  size_t expert_mlp_workspace_bytes(const kernels::ExpertMlpConfig& c) const override;
  void expert_mlp_forward(const kernels::ExpertMlpConfig& c, const kernels::ExpertMlpForwardArgs& a) override;
  void expert_mlp_backward(const kernels::ExpertMlpConfig& c, const kernels::ExpertMlpBackwardArgs& a) override;

 private:
  void protect(int prot);  // under mu_
  std::unique_ptr<kernels::Backend> inner_;
  mutable std::mutex mu_;  // maps_, open_
  std::map<void*, size_t> maps_;  // allocation -> mapped bytes
  int open_ = 0;
  std::atomic<int64_t> calls_{0};
};

// The data communicator of a guarded rank: `inner` with the backend's memory open
// during each call (NCCL reads device memory; the host does not). A call given
// memory the backend did not allocate throws, naming the call, as NCCL would fail.
class GuardedDataComm final : public transport::Communicator {
 public:
  GuardedDataComm(transport::Communicator& inner, GuardedBackend& be) : inner_(inner), be_(be) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return "guarded-" + inner_.name(); }
  using Communicator::all_to_all_v;
  void all_to_all_v(const std::vector<transport::AllToAllBuffer>& b, transport::Deadline d) override;
  void all_reduce_sum(float* data, size_t count, transport::Deadline d) override;
  // Host arrays, as NCCL's exchange_counts takes them.
  void exchange_counts(const int64_t* send, int64_t* recv, transport::Deadline d) override {
    inner_.exchange_counts(send, recv, d);
  }
  void barrier(transport::Deadline d) override { inner_.barrier(d); }
  void abort(const std::string& why) override { inner_.abort(why); }
  void send(int peer, const void* data, size_t bytes, uint32_t tag, transport::Deadline d) override;
  void recv(int peer, void* data, size_t bytes, uint32_t tag, transport::Deadline d) override;
  TransferId isend(int peer, const void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  TransferId irecv(int peer, void* data, size_t bytes, uint32_t tag, std::shared_ptr<const void> keep) override;
  bool test(TransferId id) override;

 private:
  void check_holds(const void* p, size_t bytes, const char* call) const;
  transport::Communicator& inner_;
  GuardedBackend& be_;
};

}  // namespace moe::test
