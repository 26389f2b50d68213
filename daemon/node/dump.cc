#include "moe/node/dump.h"

#include <filesystem>

#include "moe/base/file.h"
#include "moe/ep/reference.h"
#include "moe/io/layer_io.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/spec/job_spec.h"

namespace moe::node {

void dump_step(const layer_spec::JobView& job, const ModelStack& stack, const model::LayerWeights& layer0, int rank) {
  std::filesystem::create_directories(job.dump_dir);
  const LayerSnapshot& s = stack.snapshot(0);
  const moe::ExpertMap& map = stack.map(0);
  io::LayerDump d;
  d.dtype = job.dtype;
  d.shape = job.shape;
  d.top_k = job.top_k;
  d.num_tokens = job.tokens_per_rank;
  d.x = s.x.data();
  d.out = s.out.data();
  d.topk_idx = s.kept_idx.data();
  d.topk_weight = s.topk_weight.data();
  const std::vector<bool> mine = map.hosted(rank);
  for (int e = 0; e < job.shape.num_experts; ++e)
    if (mine[e]) d.experts.push_back(e);
  d.weights = &layer0;
  // Expert gradients indexed by logical expert, from this rank's slots.
  std::vector<float> g13, g2;
  if (job.train) {
    const size_t E = job.shape.num_experts, H = job.shape.hidden, I = job.shape.ffn_hidden, n13 = 2 * I * H,
                 n2 = H * I;
    g13.assign(E * n13, 0.0f);
    g2.assign(E * n2, 0.0f);
    for (int slot = 0; slot < map.slots_per_rank; ++slot) {
      const int e = map.expert_at(rank, slot);
      if (e < 0) continue;
      std::copy_n(s.grads.w13.begin() + slot * n13, n13, g13.begin() + e * n13);
      std::copy_n(s.grads.w2.begin() + slot * n2, n2, g2.begin() + e * n2);
    }
    d.grad_out = s.grad_out.data();
    d.grad_x = s.grad_x.data();
    d.grad_gate = s.grads.gate.data();
    d.grad_w13 = g13.data();
    d.grad_w2 = g2.data();
    if (stack.layer(0).shared_experts()) {
      d.grad_shared_w13 = s.grads.shared_w13.data();
      d.grad_shared_w2 = s.grads.shared_w2.data();
      d.grad_shared_gate = s.grads.shared_gate.empty() ? nullptr : s.grads.shared_gate.data();
    }
  }
  io::write_layer_dump(job.dump_dir + "/rank" + std::to_string(rank) + ".safetensors", d);
  if (rank == 0) write_file_atomically(job.dump_dir + "/spec.json", spec::to_json(job.spec));
}

}  // namespace moe::node
