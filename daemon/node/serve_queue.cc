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

namespace {

// The fields every call of a layer names, checked against the job.
void check_layer_and_rows(const layer_spec::JobView& job, int layer, int hidden, v1::JobSpec::DType dtype,
                          int64_t rows, int64_t max_rows) {
  if (layer < 0 || layer >= job.layers)
    throw InvalidArgument("layer: the job serves layers 0-" + std::to_string(job.layers - 1) + ", got " +
                          std::to_string(layer));
  if (hidden != job.shape.hidden)
    throw InvalidArgument("hidden: the job's layers take " + std::to_string(job.shape.hidden) +
                          " values a row, got " + std::to_string(hidden));
  if (dtype != job.spec.dtype())
    throw InvalidArgument("dtype: the job computes in " + v1::JobSpec::DType_Name(job.spec.dtype()) + ", got " +
                          v1::JobSpec::DType_Name(dtype));
  if (rows < 1 || rows > max_rows)
    throw InvalidArgument("rows: must be in [1, " + std::to_string(max_rows) + "] a call, got " +
                          std::to_string(rows));
}

// rows of the job's row bytes, every value finite; field names them.
std::vector<uint8_t> checked_rows(const layer_spec::JobView& job, const std::string& field, const std::string& bytes,
                                  int64_t rows, v1::JobSpec::DType dtype) {
  const int H = job.shape.hidden;
  const size_t row_bytes = kernels::dtype_size(job.dtype) * H;
  if (bytes.size() != rows * row_bytes)
    throw InvalidArgument(field + ": " + std::to_string(rows) + " rows of " + std::to_string(H) + " " +
                          v1::JobSpec::DType_Name(dtype) + " values are " + std::to_string(rows * row_bytes) +
                          " bytes, got " + std::to_string(bytes.size()));
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  if (const std::string bad = nonfinite_rows(p, rows, H, job.dtype); !bad.empty())
    throw InvalidArgument(field + ": row(s) " + bad + " hold a value that is not finite");
  return {p, p + bytes.size()};
}

std::shared_ptr<ServeCall> new_call(ServeKind kind, int layer, int64_t rows, size_t row_bytes) {
  auto c = std::make_shared<ServeCall>();
  c->kind = kind;
  c->layer = layer;
  c->rows = rows;
  c->row_bytes = row_bytes;
  c->y.resize(rows * row_bytes);
  c->queued = ServeClock::now();
  return c;
}

}  // namespace

std::shared_ptr<ServeCall> make_serve_call(const layer_spec::JobView& job, const v1::ServeForward& call,
                                           int64_t max_rows) {
  check_layer_and_rows(job, call.layer(), call.hidden(), call.dtype(), call.rows(), max_rows);
  if (call.keep_for_backward() && !job.train)
    throw InvalidArgument("keep_for_backward: the job takes no backward calls (submit it with --serve-train)");
  auto c = new_call(ServeKind::kForward, call.layer(), call.rows(), kernels::dtype_size(job.dtype) * job.shape.hidden);
  c->x = checked_rows(job, "x", call.x(), call.rows(), call.dtype());
  return c;
}

std::shared_ptr<ServeCall> make_serve_call(const layer_spec::JobView& job, const v1::ServeBackward& call,
                                           std::vector<uint8_t> x, int kept_layer) {
  const size_t row_bytes = kernels::dtype_size(job.dtype) * job.shape.hidden;
  const int64_t kept_rows = static_cast<int64_t>(x.size() / row_bytes);
  check_layer_and_rows(job, call.layer(), call.hidden(), call.dtype(), call.rows(), kept_rows);
  if (call.layer() != kept_layer)
    throw InvalidArgument("layer: handle " + std::to_string(call.handle()) + " holds rows of layer " +
                          std::to_string(kept_layer) + ", got " + std::to_string(call.layer()));
  if (call.rows() != kept_rows)
    throw InvalidArgument("rows: handle " + std::to_string(call.handle()) + " holds " + std::to_string(kept_rows) +
                          " rows, got " + std::to_string(call.rows()));
  auto c = new_call(ServeKind::kBackward, call.layer(), call.rows(), row_bytes);
  c->grad_y = checked_rows(job, "grad_y", call.grad_y(), call.rows(), call.dtype());
  c->x = std::move(x);
  return c;
}

int64_t ServeCall::rows_to_hand() const {
  int64_t n = rows - handed;
  for (const auto& [first, count] : returned) n += count;
  return n;
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
  callers_[call->caller] = ServeClock::now();
  waiting_.at(call->lane()).push_back(std::move(call));
  cv_.notify_all();
  return "";
}

void ServeQueue::abandon(const std::shared_ptr<ServeCall>& call) {
  std::lock_guard<std::mutex> lock(mu_);
  end(*call);
  auto& q = waiting_.at(call->lane());
  q.erase(std::remove(q.begin(), q.end(), call), q.end());
}

int64_t ServeQueue::queued() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queued_rows();
}

int64_t ServeQueue::queued_rows() const {
  int64_t rows = 0;
  for (const auto& layer : waiting_)
    for (const auto& c : layer) rows += c->rows_to_hand();
  return rows;
}

int64_t ServeQueue::queued_calls() const {
  int64_t calls = 0;
  for (const auto& lane : waiting_) calls += static_cast<int64_t>(lane.size());
  return calls;
}

int64_t ServeQueue::recent_callers(ServeClock::time_point now) {
  for (auto it = callers_.begin(); it != callers_.end();)
    it = it->second + kRecentCaller < now ? callers_.erase(it) : std::next(it);
  return static_cast<int64_t>(callers_.size());
}

bool ServeQueue::wait_for_step(int64_t rows, std::chrono::milliseconds max_wait) {
  std::unique_lock<std::mutex> lock(mu_);
  // At most max_wait from here (rows that came during the last step get that long
  // for the other callers to come back); an idle rank still votes every max_wait,
  // at least every millisecond: the others may have rows, and a step needs every rank.
  const auto until = ServeClock::now() + std::max(max_wait, std::chrono::milliseconds(1));
  cv_.wait_until(lock, until, [&] {
    if (!closed_.empty() || queued_rows() >= rows) return true;
    // Continuous batching: the callers of the last steps come back with their next
    // calls; waiting for them merges them into one step.
    const int64_t calls = queued_calls();
    return calls > 0 && (max_wait.count() == 0 || calls >= recent_callers(ServeClock::now()));
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

std::vector<ServePiece> ServeQueue::take(int lane, int64_t max_rows) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<ServePiece> pieces;
  auto& q = waiting_.at(lane);
  while (max_rows > 0 && !q.empty()) {
    const std::shared_ptr<ServeCall>& c = q.front();
    int64_t first = 0, n = 0;
    if (!c->returned.empty()) {  // rows a failed world gave back go first
      auto& back = c->returned.back();
      first = back.first;
      n = std::min(max_rows, back.second);
      back.first += n;
      back.second -= n;
      if (back.second == 0) c->returned.pop_back();
    } else {
      first = c->handed;
      n = std::min(max_rows, c->rows - c->handed);
      c->handed += n;
    }
    pieces.push_back({c, first, n});
    max_rows -= n;
    if (c->rows_to_hand() == 0) q.pop_front();
  }
  return pieces;
}

void ServeQueue::put_back(const std::vector<ServePiece>& pieces) {
  std::vector<std::shared_ptr<ServeCall>> failed;
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mu_);
    why = closed_;
    for (const ServePiece& p : pieces) {
      ServeCall& c = *p.call;
      if (!why.empty()) {  // the job ended meanwhile: nothing will take them
        if (end(c)) failed.push_back(p.call);
        continue;
      }
      if (c.over) continue;         // answered meanwhile (its caller stopped waiting)
      if (c.rows_to_hand() == 0) {  // it had left its lane: back in, by when it came
        auto& q = waiting_.at(c.lane());
        const auto at = std::find_if(q.begin(), q.end(), [&](const auto& o) { return o->queued > c.queued; });
        q.insert(at, p.call);
      }
      c.returned.emplace_back(p.first, p.n);
    }
    cv_.notify_all();
  }
  for (auto& c : failed) c->done(why);
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
