// A serving call's end, awaited on the daemon's io thread (serve_calls.cc,
// serve_wire.cc). Private to daemon/node.
#pragma once

#include <memory>
#include <string>

#include "moe/rpc/server.h"

namespace moe::node {

// A call's end, awaited on the io thread; end() may come from any thread.
class ServeCompletion : public std::enable_shared_from_this<ServeCompletion> {
 public:
  explicit ServeCompletion(rpc::asio::io_context& io) : io_(io), timer_(io) {}
  // The first end counts (the rows' end, or the caller's disconnect).
  void end(std::string error) {
    rpc::asio::post(io_, [self = shared_from_this(), error = std::move(error)] {
      if (self->over_) return;
      self->over_ = true;
      self->error_ = error;
      self->timer_.cancel();
    });
  }
  // True once ended (error() says how); false when the deadline came first.
  rpc::awaitable<bool> wait(rpc::asio::steady_timer::time_point deadline) {
    if (over_) co_return true;
    timer_.expires_at(deadline);
    boost::system::error_code ec;
    co_await timer_.async_wait(rpc::asio::redirect_error(rpc::use_awaitable, ec));
    co_return over_;
  }
  const std::string& error() const { return error_; }

 private:
  rpc::asio::io_context& io_;
  rpc::asio::steady_timer timer_;
  bool over_ = false;
  std::string error_;
};

}  // namespace moe::node
