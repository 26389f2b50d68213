#include "moe/node/step_source.h"

#include "moe/base/clock.h"

namespace moe::node {

SyntheticSource::SyntheticSource(const layer_spec::JobView& job, const std::vector<ExpertMap>& maps, int rank,
                                 transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                                 LayerOptions options)
    : job_(job),
      teacher_spec_(layer_spec::teacher_of(job.spec)),
      rank_(rank),
      comm_(comm),
      be_(be),
      pool_(pool),
      options_(std::move(options)) {
  if (!job_.train || job_.serve) return;  // a serving job's rows are its callers'
  teacher_ = teacher_on(maps);
  out_ = kernels::Buffer(be, job_.tokens_per_rank * job_.shape.hidden * kernels::dtype_size(job_.dtype) + 1);
}

// The teacher's layers: forward only, no balancing statistics (its spec has none).
std::vector<std::unique_ptr<ep::EpLayer>> SyntheticSource::teacher_on(const std::vector<ExpertMap>& maps) const {
  ep::LayerSpec s = layer_spec::layer_spec(teacher_spec_);
  s.train = false;
  const ep::MoeLayerConfig cfg = ep::layer_config(s);
  std::vector<std::unique_ptr<ep::EpLayer>> layers;
  for (int l = 0; l < static_cast<int>(maps.size()); ++l) {
    layers.push_back(std::make_unique<ep::EpLayer>(cfg, maps[l], comm_, be_, options_(l)));
    layers.back()->set_weights(layer_spec::layer_weights(teacher_spec_, l, maps[l].hosted(rank_), &pool_));
  }
  return layers;
}

void SyntheticSource::inputs(int step, kernels::Buffer& x, StepReport& report) {
  const double t0 = now_seconds();
  const std::vector<uint8_t> host = model::to_storage(layer_spec::step_inputs(job_.spec, rank_, step, pool_), job_.dtype);
  be_.copy_to_device(x.get(), host.data(), host.size());
  report.set_inputs_seconds(now_seconds() - t0);
}

// y = the teacher's residual stack on x.
void SyntheticSource::targets(const kernels::Buffer& x, kernels::Buffer& y, StepReport& report) {
  const double t0 = now_seconds();
  const int64_t T = job_.tokens_per_rank;
  const int64_t n = T * job_.shape.hidden;
  be_.copy(y.get(), x.get(), n * kernels::dtype_size(job_.dtype));
  for (auto& layer : teacher_) {
    layer->forward(y.get(), T, token_begin(), out_.get());
    report.note_chunks(layer->stats().transfer.chunks);
    be_.add(y.get(), out_.get(), job_.dtype, n);
  }
  report.set_teacher_seconds(now_seconds() - t0);
}

// Teacher weights are never copied: the staged layers build theirs from the RNG.
void SyntheticSource::stage(const std::vector<ExpertMap>& next) {
  staged_teacher_.clear();
  if (!teacher_.empty()) staged_teacher_ = teacher_on(next);
}

void SyntheticSource::switch_to_staged() {
  if (!staged_teacher_.empty()) teacher_ = std::move(staged_teacher_);
  staged_teacher_.clear();
}

void SyntheticSource::drop_staged() { staged_teacher_.clear(); }

}  // namespace moe::node
