// Real child processes for integration tests (Ceph qa/standalone style): spawn an
// executable with arguments, its stdout and stderr captured to a file; wait with a
// deadline; kill. The destructor kills a child still running, so a failed test
// leaves nothing behind.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

namespace moe::test {

class Process {
 public:
  static Process spawn(const std::vector<std::string>& argv);
  Process(Process&& o) noexcept;
  Process& operator=(Process&& o) noexcept;
  Process(const Process&) = delete;
  ~Process();

  // Exit code (or 128 + signal); -1 if still running at the deadline.
  int wait(std::chrono::milliseconds timeout);
  void kill(int sig);
  std::string output() const;  // everything the child wrote so far
  pid_t pid() const { return pid_; }

 private:
  Process() = default;
  pid_t pid_ = -1;
  int status_ = -1;
  bool reaped_ = false;
  std::string log_path_;
};

// A small text file's contents without trailing newlines or spaces ("" if absent).
std::string read_text_file(const std::string& path);

// Sets an environment variable for the scope (the processes a test starts inherit it).
struct ScopedEnv {
  ScopedEnv(const char* name, const std::string& value) : name_(name) { ::setenv(name, value.c_str(), 1); }
  ~ScopedEnv() { ::unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace moe::test
