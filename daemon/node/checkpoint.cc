#include "moe/node/checkpoint.h"

#include <filesystem>
#include <map>
#include <memory>

#include "moe/base/check.h"
#include "moe/base/file.h"
#include "moe/io/safetensors.h"
#include "moe/layer_spec/job_layers.h"
#include "moe/spec/checkpoint_manifest.h"
#include "moe/spec/expert_map_codec.h"
#include "moe/spec/job_spec.h"

namespace moe::node {
namespace {

namespace fs = std::filesystem;
using Shape = std::vector<int64_t>;

std::string layer_name(int l) { return "layers." + std::to_string(l) + "."; }

// A tensor and, when present, its Adam moments.
void add_state(io::SafetensorsWriter& out, const std::string& name, const Shape& shape, const float* w,
               const float* m, const float* v) {
  out.add_f32(name, shape, w);
  if (!m) return;
  out.add_f32(name + ".exp_avg", shape, m);
  out.add_f32(name + ".exp_avg_sq", shape, v);
}

// One SwiGLU's [gate | up | down] state (ExpertState layout) under `prefix`.
void add_swiglu(io::SafetensorsWriter& out, const std::string& prefix, const ep::ExpertState& st, int64_t H,
                int64_t I) {
  const bool moments = !st.m.empty();
  const size_t offsets[3] = {0, static_cast<size_t>(I * H), static_cast<size_t>(2 * I * H)};
  const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
  const Shape shapes[3] = {{I, H}, {I, H}, {H, I}};
  for (int i = 0; i < 3; ++i)
    add_state(out, prefix + names[i] + ".weight", shapes[i], st.weights.data() + offsets[i],
              moments ? st.m.data() + offsets[i] : nullptr, moments ? st.v.data() + offsets[i] : nullptr);
}

void write_rank_file(const fs::path& folder, ModelStack& stack, int rank) {
  const layer_spec::JobView& job = stack.job();
  io::SafetensorsWriter out;
  out.set_metadata("format", "moed-checkpoint-1");
  const int64_t H = job.shape.hidden, I = job.shape.ffn_hidden;
  for (int l = 0; l < stack.num_layers(); ++l) {
    const moe::ExpertMap& map = stack.map(l);
    std::vector<bool> written(job.shape.num_experts, false);
    for (int s = 0; s < map.slots_per_rank; ++s) {
      const int e = map.expert_at(rank, s);
      if (e < 0 || written[e]) continue;
      written[e] = true;
      ep::ExpertState st;
      st.resize(static_cast<int>(H), static_cast<int>(I), job.adam);
      stack.layer(l).export_slot(s, st);
      add_swiglu(out, layer_name(l) + "experts." + std::to_string(e) + ".", st, H, I);
    }
  }
  out.write((folder / ("rank" + std::to_string(rank) + ".safetensors")).string());
}

void write_router_file(const fs::path& folder, ModelStack& stack) {
  const layer_spec::JobView& job = stack.job();
  io::SafetensorsWriter out;
  out.set_metadata("format", "moed-checkpoint-1");
  const int64_t H = job.shape.hidden, E = job.shape.num_experts;
  for (int l = 0; l < stack.num_layers(); ++l) {
    const ep::EpLayer::ReplicatedState st = stack.layer(l).replicated_state(job.adam);
    const std::string p = layer_name(l);
    const auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
    add_state(out, p + "gate.weight", {E, H}, st.gate.master.data(), ptr(st.gate.m), ptr(st.gate.v));
    if (!st.selection_bias.empty()) out.add_f32(p + "gate.e_score_correction_bias", {E}, st.selection_bias.data());
    if (!st.shared.weights.empty())
      add_swiglu(out, p + "shared_experts.", st.shared, H, job.shape.shared_ffn_hidden);
    if (!st.shared_gate.master.empty())
      add_state(out, p + "shared_expert_gate.weight", {1, H}, st.shared_gate.master.data(), ptr(st.shared_gate.m),
                ptr(st.shared_gate.v));
  }
  out.write((folder / "router.safetensors").string());
}

void write_manifest(const fs::path& folder, const v1::StartJob& job, const ModelStack& stack, int steps_done,
                    const std::vector<std::vector<float>>& loads) {
  v1::CheckpointManifest m;
  m.set_format(1);
  m.set_job_id(job.job_id());
  *m.mutable_spec() = job.spec();
  m.set_step(steps_done);
  m.set_rng_position(steps_done);
  m.set_world_size(job.world_size());
  m.set_devices_per_node(job.devices_per_node());
  for (int l = 0; l < stack.num_layers(); ++l) {
    *m.add_maps() = spec::to_proto(stack.map(l), l);
    *m.add_expert_loads()->mutable_tokens() = {loads[l].begin(), loads[l].end()};
  }
  if (stack.job().serve)
    for (int64_t s : stack.served_steps()) m.add_layer_steps(s);
  auto add_file = [&](const std::string& name, int rank) {
    v1::CheckpointFile* f = m.add_files();
    f->set_name(name);
    f->set_rank(rank);
    f->set_bytes(static_cast<double>(fs::file_size(folder / name)));
  };
  for (int r = 0; r < job.world_size(); ++r) add_file("rank" + std::to_string(r) + ".safetensors", r);
  add_file("router.safetensors", -1);
  write_file_atomically((folder / spec::kManifestName).string(), spec::to_json(m));
}

// One state triple from a reader; moments only when the checkpoint has them.
ep::TensorState read_state(const io::SafetensorsReader& f, const std::string& name, const Shape& shape) {
  ep::TensorState s;
  s.master = f.read_f32(name, shape);
  if (f.has(name + ".exp_avg")) {
    s.m = f.read_f32(name + ".exp_avg", shape);
    s.v = f.read_f32(name + ".exp_avg_sq", shape);
  }
  return s;
}

ep::ExpertState read_swiglu(const io::SafetensorsReader& f, const std::string& prefix, int64_t H, int64_t I) {
  ep::ExpertState st;
  const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
  const Shape shapes[3] = {{I, H}, {I, H}, {H, I}};
  for (int i = 0; i < 3; ++i) {
    const ep::TensorState t = read_state(f, prefix + names[i] + ".weight", shapes[i]);
    st.weights.insert(st.weights.end(), t.master.begin(), t.master.end());
    st.m.insert(st.m.end(), t.m.begin(), t.m.end());
    st.v.insert(st.v.end(), t.v.begin(), t.v.end());
  }
  return st;
}

void load_replicated(const io::SafetensorsReader& f, ModelStack& stack) {
  const model::LayerShape& shape = stack.job().shape;
  const int64_t H = shape.hidden, E = shape.num_experts, Is = shape.shared_ffn_hidden;
  for (int l = 0; l < stack.num_layers(); ++l) {
    const std::string p = layer_name(l);
    ep::EpLayer::ReplicatedState st;
    st.gate = read_state(f, p + "gate.weight", {E, H});
    if (f.has(p + "gate.e_score_correction_bias")) st.selection_bias = f.read_f32(p + "gate.e_score_correction_bias", {E});
    if (Is > 0) st.shared = read_swiglu(f, p + "shared_experts.", H, Is);
    if (shape.shared_gate) st.shared_gate = read_state(f, p + "shared_expert_gate.weight", {1, H});
    stack.layer(l).set_replicated_state(st);
  }
}

// The rank whose file holds expert e in the checkpoint's map of a layer: its primary's.
int holder_of(const v1::PlacementMap& m, int e) {
  for (int slot = 0; slot < m.phy2log_size(); ++slot)
    if (m.phy2log(slot) == e) return slot / m.slots_per_rank();
  detail::fail("checkpoint: layer ", m.layer(), " places no replica of expert ", e);
}

}  // namespace

void write_checkpoint(const v1::StartJob& job, ModelStack& stack, int steps_done, int rank,
                      transport::Communicator& comm, transport::Deadline deadline) {
  const fs::path folder = fs::path(layer_spec::JobView(job.spec()).checkpoint_dir) / spec::step_folder_name(steps_done);
  std::vector<std::vector<float>> loads = stack.expert_loads();
  for (auto& l : loads) comm.all_reduce_sum(l.data(), l.size(), deadline);
  if (rank == 0) {  // a folder being rewritten is incomplete until its new manifest
    fs::create_directories(folder);
    fs::remove(folder / spec::kManifestName);
  }
  comm.barrier(deadline);
  write_rank_file(folder, stack, rank);
  if (rank == 0) write_router_file(folder, stack);
  comm.barrier(deadline);  // every rank's file is whole
  if (rank == 0) write_manifest(folder, job, stack, steps_done, loads);
}

void load_checkpoint(const std::string& folder, const v1::CheckpointManifest& m, ModelStack& stack, int rank) {
  spec::check_files(folder, m);  // the agent checked that its spec resumes as the stack's
  load_replicated(io::SafetensorsReader((fs::path(folder) / "router.safetensors").string()), stack);
  std::map<int, std::unique_ptr<io::SafetensorsReader>> files;  // opened when first needed; tensors read by seek
  const int64_t H = stack.job().shape.hidden, I = stack.job().shape.ffn_hidden;
  for (int l = 0; l < stack.num_layers(); ++l) {
    const moe::ExpertMap& map = stack.map(l);
    for (int s = 0; s < map.slots_per_rank; ++s) {
      const int e = map.expert_at(rank, s);
      if (e < 0) continue;
      const int holder = holder_of(m.maps(l), e);
      auto& f = files[holder];
      if (!f) f = std::make_unique<io::SafetensorsReader>((fs::path(folder) / ("rank" + std::to_string(holder) + ".safetensors")).string());
      stack.layer(l).import_slot(s, read_swiglu(*f, layer_name(l) + "experts." + std::to_string(e) + ".", H, I));
    }
  }
  if (stack.job().serve) {  // Adam's step count per layer; a train job's checkpoint: its steps, every layer
    std::vector<int64_t> steps(m.layer_steps().begin(), m.layer_steps().end());
    if (static_cast<int>(steps.size()) != stack.num_layers()) steps.assign(stack.num_layers(), m.step());
    stack.resume_served_steps(std::move(steps));
  }
}

}  // namespace moe::node
