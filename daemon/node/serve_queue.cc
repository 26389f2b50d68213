#include "moe/node/serve_queue.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "moe/base/check.h"
#include "moe/kernels/types.h"

namespace moe::node {
namespace {

// The rows of x [rows, hidden] that hold a value that is not finite (the first few).
std::string nonfinite_rows(const uint8_t* x, int64_t rows, int hidden, kernels::DType dtype) {
  std::string which;
  int found = 0;
  for (int64_t r = 0; r < rows && found < 8; ++r) {
    bool bad = false;
    for (int h = 0; h < hidden && !bad; ++h) {
      float v;
      if (dtype == kernels::DType::kF32) {
        std::memcpy(&v, x + (r * hidden + h) * 4, 4);
      } else {
        kernels::bf16_t b;
        std::memcpy(&b, x + (r * hidden + h) * 2, 2);
        v = kernels::bf16_to_f32(b);
      }
      bad = !std::isfinite(v);
    }
    if (bad) which += (found++ ? ", " : "") + std::to_string(r);
  }
  return which;
}

}  // namespace

std::shared_ptr<ServeCall> make_serve_call(const layer_spec::JobView& job, const v1::ServeForward& call,
                                           int64_t max_rows) {
  const int H = job.shape.hidden;
  if (call.layer() < 0 || call.layer() >= job.layers)
    throw InvalidArgument("layer: the job serves layers 0-" + std::to_string(job.layers - 1) + ", got " +
                          std::to_string(call.layer()));
  if (call.hidden() != H)
    throw InvalidArgument("hidden: the job's layers take " + std::to_string(H) + " values a row, got " +
                          std::to_string(call.hidden()));
  if (call.dtype() != job.spec.dtype())
    throw InvalidArgument("dtype: the job computes in " + v1::JobSpec::DType_Name(job.spec.dtype()) + ", got " +
                          v1::JobSpec::DType_Name(call.dtype()));
  if (call.rows() < 1 || call.rows() > max_rows)
    throw InvalidArgument("rows: must be in [1, " + std::to_string(max_rows) + "] a call, got " +
                          std::to_string(call.rows()));
  const size_t row_bytes = kernels::dtype_size(job.dtype) * H;
  if (call.x().size() != call.rows() * row_bytes)
    throw InvalidArgument("x: " + std::to_string(call.rows()) + " rows of " + std::to_string(H) + " " +
                          v1::JobSpec::DType_Name(call.dtype()) + " values are " +
                          std::to_string(call.rows() * row_bytes) + " bytes, got " + std::to_string(call.x().size()));
  const auto* x = reinterpret_cast<const uint8_t*>(call.x().data());
  if (const std::string bad = nonfinite_rows(x, call.rows(), H, job.dtype); !bad.empty())
    throw InvalidArgument("x: row(s) " + bad + " hold a value that is not finite");
  auto c = std::make_shared<ServeCall>();
  c->layer = call.layer();
  c->rows = call.rows();
  c->row_bytes = row_bytes;
  c->x.assign(x, x + call.x().size());
  c->y.resize(c->x.size());
  c->queued = ServeClock::now();
  return c;
}

bool ServeQueue::end(ServeCall& call) {
  if (call.over) return false;
  call.over = true;
  return true;
}

std::string ServeQueue::push(std::shared_ptr<ServeCall> call, int64_t max_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_.empty()) return closed_;
  if (const int64_t queued = queued_rows(); queued + call->rows > max_rows)
    return "the node's queue is full (" + std::to_string(queued) + " rows wait, at most " + std::to_string(max_rows) +
           "): call again later";
  waiting_.at(call->layer).push_back(std::move(call));
  cv_.notify_all();
  return "";
}

void ServeQueue::abandon(const std::shared_ptr<ServeCall>& call) {
  std::lock_guard<std::mutex> lock(mu_);
  end(*call);
  auto& q = waiting_.at(call->layer);
  q.erase(std::remove(q.begin(), q.end(), call), q.end());
}

int64_t ServeQueue::queued_rows() const {
  int64_t rows = 0;
  for (const auto& layer : waiting_)
    for (const auto& c : layer) rows += c->rows - c->handed;
  return rows;
}

bool ServeQueue::wait_for_step(int64_t rows, std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> lock(mu_);
  // An idle rank still votes every max_wait (at least every millisecond): the
  // others may have rows, and a step needs every rank.
  const auto until = ServeClock::now() + std::max(max_wait, std::chrono::milliseconds(1));
  cv_.wait_until(lock, until, [&] {
    if (!closed_.empty() || queued_rows() >= rows) return true;
    for (const auto& layer : waiting_)
      if (!layer.empty() && layer.front()->queued + max_wait <= ServeClock::now()) return true;
    return false;
  });
  return closed_.empty();
}

std::vector<float> ServeQueue::ages(ServeClock::time_point now) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<float> out(waiting_.size(), 0.0f);
  for (size_t l = 0; l < waiting_.size(); ++l)
    if (!waiting_[l].empty())  // at least a microsecond: a queued row always counts
      out[l] = std::max(1e-3f, std::chrono::duration<float, std::milli>(now - waiting_[l].front()->queued).count());
  return out;
}

std::vector<ServePiece> ServeQueue::take(int layer, int64_t max_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ServePiece> pieces;
  auto& q = waiting_.at(layer);
  while (max_rows > 0 && !q.empty()) {
    const std::shared_ptr<ServeCall>& c = q.front();
    const int64_t n = std::min(max_rows, c->rows - c->handed);
    pieces.push_back({c, c->handed, n});
    c->handed += n;
    max_rows -= n;
    if (c->handed == c->rows) q.pop_front();
  }
  return pieces;
}

void ServeQueue::finish(const ServePiece& piece, const uint8_t* y) {
  ServeCall& c = *piece.call;
  bool completes = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (c.over) return;  // failed meanwhile
    std::memcpy(c.y.data() + piece.first * c.row_bytes, y, piece.n * c.row_bytes);
    c.back += piece.n;
    completes = c.back == c.rows && end(c);
  }
  if (completes) c.done("");
}

void ServeQueue::fail(const ServePiece& piece, const std::string& why) {
  bool failed = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed = end(*piece.call);
  }
  if (failed) piece.call->done(why);
}

void ServeQueue::close(const std::string& why) {
  std::vector<std::shared_ptr<ServeCall>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_.empty()) return;
    closed_ = why;
    for (auto& layer : waiting_) {
      for (auto& c : layer)
        if (end(*c)) failed.push_back(c);
      layer.clear();
    }
    cv_.notify_all();
  }
  for (auto& c : failed) c->done(why);
}

}  // namespace moe::node
