// The one place that includes Boost.Asio for the control plane. Boost 1.74 needs
// <utility> before any Asio header (awaitable.hpp uses std::exchange).
#pragma once

#include <utility>

#include <set>

#include <boost/asio.hpp>
#include <boost/asio/awaitable.hpp>
#include <boost/asio/co_spawn.hpp>
#include <boost/asio/detached.hpp>
#include <boost/asio/redirect_error.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/use_awaitable.hpp>

namespace moe::rpc {

namespace asio = boost::asio;
using asio::awaitable;
using asio::use_awaitable;

// A wake-up for coroutines on one io_context: each waiter co_awaits
// wait(deadline) on a timer of its own; notify_all() cancels every waiting timer.
// Waiters re-check their condition after waking (it may be the deadline). Asio
// 1.74 has no channels; per-waiter timers do the job.
class AsyncEvent {
 public:
  explicit AsyncEvent(asio::io_context& io) : io_(io) {}
  awaitable<void> wait(asio::steady_timer::time_point deadline) {
    asio::steady_timer timer(io_);
    timer.expires_at(deadline);
    waiters_.insert(&timer);
    boost::system::error_code ec;
    co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));
    waiters_.erase(&timer);
  }
  void notify_all() {
    for (asio::steady_timer* t : waiters_) t->cancel();
  }

 private:
  asio::io_context& io_;
  std::set<asio::steady_timer*> waiters_;
};

}  // namespace moe::rpc
