#include "moe/transport/transfer_worker.h"

namespace moe::transport {

TransferWorker::TransferWorker() : thread_([this] { run(); }) {}

TransferWorker::~TransferWorker() {
  drain();
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

TransferWorker::OpId TransferWorker::post(std::function<void()> op) {
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(op));
  cv_.notify_all();
  return ++posted_;
}

void TransferWorker::wait(OpId id) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_ >= id; });
  if (error_) std::rethrow_exception(error_);
}

void TransferWorker::drain() noexcept {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return done_ >= posted_; });
  error_ = nullptr;
}

void TransferWorker::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_, nothing left
    std::function<void()> op = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = error_ != nullptr;  // a failed op fails what was queued after it
    lock.unlock();
    std::exception_ptr failed;
    if (!skip) {
      try {
        op();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    op = nullptr;
    lock.lock();
    if (failed && !error_) error_ = failed;
    ++done_;
    cv_.notify_all();
  }
}

}  // namespace moe::transport
