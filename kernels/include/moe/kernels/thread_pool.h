// A fixed pool of worker threads that a rank owns and hands to the kernels.
//
// The caller of parallel_for is thread 0 and works too, so a pool of N threads
// spawns N-1 workers. Workers block on a condition variable between calls (ranks
// share cores; nobody spins). Not re-entrant: one parallel_for at a time per pool.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace moe::kernels {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(task, thread) for every task in [0, num_tasks), tasks handed out in
  // increasing order to whichever thread is free (dynamic scheduling); thread is in
  // [0, num_threads). Returns when all tasks finished. The first exception a task
  // throws is rethrown here; the remaining tasks are skipped.
  void parallel_for(int64_t num_tasks, const std::function<void(int64_t task, int thread)>& fn);

 private:
  void worker_main(int thread);
  void run_tasks(int thread);

  const int num_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_;
  std::condition_variable done_cv_;
  uint64_t generation_ = 0;  // bumped per parallel_for; guarded by mu_
  int busy_workers_ = 0;     // workers still inside the current call; guarded by mu_
  bool stop_ = false;
  // State of the current call; written before generation_ is bumped.
  const std::function<void(int64_t, int)>* fn_ = nullptr;
  int64_t num_tasks_ = 0;
  alignas(64) std::atomic<int64_t> next_task_{0};
  std::exception_ptr error_;  // guarded by mu_
};

}  // namespace moe::kernels
