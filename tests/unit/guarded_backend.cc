#include "guarded_backend.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

#include "moe/base/check.h"
#include "moe/kernels/cpu_backend.h"

namespace moe::test {

using namespace kernels;

GuardedBackend::GuardedBackend(ThreadPool& pool) : inner_(make_cpu_backend(pool)) {}

GuardedBackend::~GuardedBackend() {
  for (auto& [p, bytes] : maps_) ::munmap(p, bytes);
}

void GuardedBackend::protect(int prot) {
  for (auto& [p, bytes] : maps_) MOE_CHECK(::mprotect(p, bytes, prot) == 0, "guarded backend: mprotect failed");
}

GuardedBackend::Open::Open(GuardedBackend& g) : g_(g) {
  std::lock_guard<std::mutex> lock(g_.mu_);
  if (g_.open_++ == 0) g_.protect(PROT_READ | PROT_WRITE);
  ++g_.calls_;
}

GuardedBackend::Open::~Open() {
  std::lock_guard<std::mutex> lock(g_.mu_);
  if (--g_.open_ == 0) g_.protect(PROT_NONE);
}

bool GuardedBackend::holds(const void* p, size_t bytes) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = maps_.upper_bound(const_cast<void*>(p));
  if (it == maps_.begin()) return false;
  --it;
  const auto* base = static_cast<const uint8_t*>(it->first);
  const auto* q = static_cast<const uint8_t*>(p);
  return q >= base && q + bytes <= base + it->second;
}

void* GuardedBackend::alloc(size_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const size_t mapped = (std::max<size_t>(bytes, 1) + page - 1) / page * page;
  void* p = ::mmap(nullptr, mapped, open_ ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  MOE_CHECK(p != MAP_FAILED, "guarded backend: out of memory allocating ", bytes, " bytes");
  maps_[p] = mapped;
  return p;
}

void GuardedBackend::free(void* p) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto it = maps_.find(p);
  MOE_CHECK(it != maps_.end(), "guarded backend: free of a pointer it did not allocate");
  ::munmap(p, it->second);
  maps_.erase(it);
}

// Every other call: the memory open for the inner CPU backend, closed after.
#define GUARDED(call) \
  Open open(*this);   \
  return inner_->call

void GuardedBackend::copy_to_device(void* d, const void* s, size_t n) { GUARDED(copy_to_device(d, s, n)); }
void GuardedBackend::copy_to_host(void* d, const void* s, size_t n) { GUARDED(copy_to_host(d, s, n)); }
void GuardedBackend::copy(void* d, const void* s, size_t n) { GUARDED(copy(d, s, n)); }
void GuardedBackend::fill_zero(void* p, size_t n) { GUARDED(fill_zero(p, n)); }
void GuardedBackend::convert(const void* s, DType sd, void* d, DType dd, int64_t n) { GUARDED(convert(s, sd, d, dd, n)); }
void GuardedBackend::pack_rows(kernels::WireFormat f, const void* rows, DType dtype, int64_t n, int hidden, void* wire) {
  GUARDED(pack_rows(f, rows, dtype, n, hidden, wire));
}
void GuardedBackend::unpack_rows(kernels::WireFormat f, const void* wire, int64_t n, int hidden, void* rows,
                                 DType dtype) {
  GUARDED(unpack_rows(f, wire, n, hidden, rows, dtype));
}
void GuardedBackend::add(void* d, const void* s, DType t, int64_t n) { GUARDED(add(d, s, t, n)); }
std::unique_ptr<PackedWeights> GuardedBackend::make_router_weights(const RouterConfig& c) {
  GUARDED(make_router_weights(c));
}
void GuardedBackend::pack_router_weights(PackedWeights& p, const float* w) { GUARDED(pack_router_weights(p, w)); }
std::unique_ptr<PackedWeights> GuardedBackend::make_expert_weights(const ExpertMlpConfig& c) {
  GUARDED(make_expert_weights(c));
}
void GuardedBackend::update_expert_weights(const OptimizerConfig& c, const OptimizerArgs& w13,
                                           const OptimizerArgs& w2, PackedWeights& p, int num_experts) {
  GUARDED(update_expert_weights(c, w13, w2, p, num_experts));
}
void GuardedBackend::pack_expert_weights(PackedWeights& p, const float* w13, const float* w2, int first, int count) {
  GUARDED(pack_expert_weights(p, w13, w2, first, count));
}
size_t GuardedBackend::router_workspace_bytes(const RouterConfig& c) const { return inner_->router_workspace_bytes(c); }
void GuardedBackend::router_forward(const RouterConfig& c, const RouterForwardArgs& a) { GUARDED(router_forward(c, a)); }
void GuardedBackend::router_backward(const RouterConfig& c, const RouterBackwardArgs& a) { GUARDED(router_backward(c, a)); }
size_t GuardedBackend::capacity_workspace_bytes(const CapacityConfig& c) const {
  return inner_->capacity_workspace_bytes(c);
}
void GuardedBackend::capacity_drop(const CapacityConfig& c, const CapacityArgs& a) { GUARDED(capacity_drop(c, a)); }
void GuardedBackend::select_replicas(int64_t T, int K, int E, const ReplicaArgs& a) {
  GUARDED(select_replicas(T, K, E, a));
}
size_t GuardedBackend::dispatch_layout_workspace_bytes(const DispatchLayoutConfig& c) const {
  return inner_->dispatch_layout_workspace_bytes(c);
}
void GuardedBackend::dispatch_layout(const DispatchLayoutConfig& c, const DispatchLayoutArgs& a) {
  GUARDED(dispatch_layout(c, a));
}
size_t GuardedBackend::permute_layout_workspace_bytes(const PermuteLayoutConfig& c) const {
  return inner_->permute_layout_workspace_bytes(c);
}
void GuardedBackend::permute_layout(const PermuteLayoutConfig& c, const PermuteLayoutArgs& a) {
  GUARDED(permute_layout(c, a));
}
void GuardedBackend::permute(const PermuteConfig& c, const PermuteArgs& a) { GUARDED(permute(c, a)); }
void GuardedBackend::unpermute(const UnpermuteConfig& c, const UnpermuteArgs& a) { GUARDED(unpermute(c, a)); }
void GuardedBackend::unpermute_scalars(const int32_t* pos, int64_t n, int k, const float* perm, float* pair) {
  GUARDED(unpermute_scalars(pos, n, k, perm, pair));
}
void GuardedBackend::combine_pair_scalars(const int32_t* slot, const int32_t* send_row, int64_t T, int K, int R,
                                          int S, const float* rows, float* pair) {
  GUARDED(combine_pair_scalars(slot, send_row, T, K, R, S, rows, pair));
}
void GuardedBackend::swiglu_forward(const SwigluConfig& c, const SwigluForwardArgs& a) { GUARDED(swiglu_forward(c, a)); }
void GuardedBackend::swiglu_backward(const SwigluConfig& c, const SwigluBackwardArgs& a) {
  GUARDED(swiglu_backward(c, a));
}
void GuardedBackend::grouped_gemm(const GroupedGemmConfig& c, const GroupedGemmArgs& a) { GUARDED(grouped_gemm(c, a)); }
void GuardedBackend::optimizer_step(const OptimizerConfig& c, const OptimizerArgs& a) { GUARDED(optimizer_step(c, a)); }
size_t GuardedBackend::expert_mlp_workspace_bytes(const ExpertMlpConfig& c) const {
  return inner_->expert_mlp_workspace_bytes(c);
}
void GuardedBackend::expert_mlp_forward(const ExpertMlpConfig& c, const ExpertMlpForwardArgs& a) {
  GUARDED(expert_mlp_forward(c, a));
}
void GuardedBackend::expert_mlp_backward(const ExpertMlpConfig& c, const ExpertMlpBackwardArgs& a) {
  GUARDED(expert_mlp_backward(c, a));
}

#undef GUARDED

void GuardedDataComm::check_holds(const void* p, size_t bytes, const char* call) const {
  MOE_CHECK(bytes == 0 || be_.holds(p, bytes), "guarded data communicator: ", call, " given ", bytes,
            " bytes the backend did not allocate (device memory only, as NCCL)");
}

namespace {

// The last byte a buffer's segments reach.
size_t extent(const transport::Segments* s) {
  size_t end = 0;
  if (s)
    for (size_t r = 0; r < s->bytes.size(); ++r)
      if (s->bytes[r]) end = std::max(end, s->offset[r] + s->bytes[r]);
  return end;
}

}  // namespace

void GuardedDataComm::all_to_all_v(const std::vector<transport::AllToAllBuffer>& b, transport::Deadline d) {
  for (const transport::AllToAllBuffer& x : b) {
    check_holds(x.send, extent(x.send_segs), "all_to_all_v (send)");
    check_holds(x.recv, extent(x.recv_segs), "all_to_all_v (recv)");
  }
  GuardedBackend::Open open(be_);
  inner_.all_to_all_v(b, d);
}

void GuardedDataComm::all_reduce_sum(float* data, size_t count, transport::Deadline d) {
  check_holds(data, 4 * count, "all_reduce_sum");
  GuardedBackend::Open open(be_);
  inner_.all_reduce_sum(data, count, d);
}

void GuardedDataComm::send(int peer, const void* data, size_t bytes, uint32_t tag, transport::Deadline d) {
  check_holds(data, bytes, "send");
  GuardedBackend::Open open(be_);
  inner_.send(peer, data, bytes, tag, d);
}

void GuardedDataComm::recv(int peer, void* data, size_t bytes, uint32_t tag, transport::Deadline d) {
  check_holds(data, bytes, "recv");
  GuardedBackend::Open open(be_);
  inner_.recv(peer, data, bytes, tag, d);
}

transport::Communicator::TransferId GuardedDataComm::isend(int peer, const void* data, size_t bytes, uint32_t tag,
                                                           std::shared_ptr<const void> keep) {
  check_holds(data, bytes, "isend");
  GuardedBackend::Open open(be_);
  return inner_.isend(peer, data, bytes, tag, std::move(keep));
}

transport::Communicator::TransferId GuardedDataComm::irecv(int peer, void* data, size_t bytes, uint32_t tag,
                                                           std::shared_ptr<const void> keep) {
  check_holds(data, bytes, "irecv");
  GuardedBackend::Open open(be_);
  return inner_.irecv(peer, data, bytes, tag, std::move(keep));
}

bool GuardedDataComm::test(TransferId id) {
  GuardedBackend::Open open(be_);
  return inner_.test(id);
}

}  // namespace moe::test
