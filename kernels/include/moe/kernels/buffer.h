// RAII ownership of backend memory.
#pragma once

#include <cstddef>
#include <utility>

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

}  // namespace moe::kernels
