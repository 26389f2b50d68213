#include "moe/node/step_source.h"

#include <cmath>

#include "moe/base/check.h"
#include "moe/base/clock.h"
#include "moe/io/safetensors.h"

namespace moe::node {

SyntheticSource::SyntheticSource(const layer_spec::JobView& job, const std::vector<ExpertMap>& maps, int rank,
                                 transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                                 LayerOptions options)
    : job_(job),
      rank_(rank),
      comm_(comm),
      be_(be),
      teacher_spec_(layer_spec::teacher_of(job.spec)),
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

namespace {

// Layer 0's recorded rows of a routing trace, checked.
std::vector<float> recorded_rows(const std::string& path, int hidden) {
  const io::SafetensorsReader file(path);
  MOE_CHECK(file.has("layer0.hidden"), "inputs: ", path,
            " has no layer0.hidden (a serving job records its rows with --trace-dir and --trace-hidden)");
  const std::vector<int64_t>& shape = file.info("layer0.hidden").shape;
  MOE_CHECK(shape.size() == 2 && shape[0] > 0, "inputs: ", path, " holds no rows of layer 0 (shape ",
            io::shape_str(shape), ")");
  MOE_CHECK(shape[1] == hidden, "inputs: ", path, " holds rows of ", shape[1], " values, the job's hidden is ", hidden);
  std::vector<float> rows = file.read_f32("layer0.hidden", shape);
  for (size_t i = 0; i < rows.size(); ++i)
    MOE_CHECK(std::isfinite(rows[i]), "inputs: ", path, " row ", i / hidden, " holds a value that is not finite");
  return rows;
}

}  // namespace

RecordedSource::RecordedSource(const layer_spec::JobView& job, const std::vector<ExpertMap>& maps, int rank,
                               transport::Communicator& comm, kernels::Backend& be, kernels::ThreadPool& pool,
                               LayerOptions options)
    : SyntheticSource(job, maps, rank, comm, be, pool, std::move(options)),
      rows_(recorded_rows(job.inputs, job.shape.hidden)) {}

void RecordedSource::inputs(int step, kernels::Buffer& x, StepReport& report) {
  const double t0 = now_seconds();
  const int64_t T = job_.tokens_per_rank, H = job_.shape.hidden, n = static_cast<int64_t>(rows_.size()) / H;
  std::vector<float> tokens(T * H);
  const int64_t first = (static_cast<int64_t>(step) * comm_.size() + rank_) * T;
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(rows_.data() + ((first + t) % n) * H, H, tokens.data() + t * H);
  const std::vector<uint8_t> host = model::to_storage(tokens, job_.dtype);
  be_.copy_to_device(x.get(), host.data(), host.size());
  report.set_inputs_seconds(now_seconds() - t0);
}

}  // namespace moe::node
