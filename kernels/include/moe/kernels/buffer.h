// RAII ownership of backend memory, and copies between it and host vectors.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "moe/kernels/api.h"

namespace moe::kernels {

class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend& be, size_t bytes) : be_(&be), bytes_(bytes), p_(bytes ? be.alloc(bytes) : nullptr) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      be_ = std::exchange(o.be_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      p_ = std::exchange(o.p_, nullptr);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void reset() {
    if (p_) be_->free(p_);
    p_ = nullptr;
    bytes_ = 0;
  }
  void* get() const { return p_; }
  template <typename T>
  T* as() const { return static_cast<T*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* be_ = nullptr;
  size_t bytes_ = 0;
  void* p_ = nullptr;
};

// n elements of T at p in the backend's memory, copied to a host vector.
template <typename T>
std::vector<T> to_host(Backend& be, const void* p, size_t n) {
  std::vector<T> v(n);
  if (n) be.copy_to_host(v.data(), p, n * sizeof(T));
  return v;
}

// A buffer holding a copy of v (at least 64 bytes: an empty one still has an address).
template <typename T>
Buffer to_backend(Backend& be, const std::vector<T>& v) {
  Buffer b(be, std::max<size_t>(v.size() * sizeof(T), 64));
  if (!v.empty()) be.copy_to_device(b.get(), v.data(), v.size() * sizeof(T));
  return b;
}

}  // namespace moe::kernels
