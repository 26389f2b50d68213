// The Prometheus scrape endpoint of moed and moe-agent: GET /metrics answers the
// registry in the text exposition format, GET /healthz "ok" (the process serves:
// what liveness probes ask); anything else gets 404, 405 or 400
// (request_head.h). It runs on
// its own thread and io_context, so a scrape never waits for the control plane.
//
// Not civetweb (prometheus-cpp's pull exposer): its workers run on fixed 100 KiB
// stacks, and glibc carves each thread's static TLS out of that stack; OpenBLAS
// alone holds 60 KiB of static TLS, so moed's scrapes overflowed and crashed it.
#pragma once

#include <memory>
#include <string>

namespace prometheus {
class Registry;
}

namespace moe::http {

class MetricsEndpoint {
 public:
  // listen: "PORT" (loopback only) or "HOST:PORT"; port 0 picks a free one.
  // Throws rpc::RpcError for a malformed address, boost::system::system_error if
  // the port cannot be bound.
  MetricsEndpoint(const std::string& listen, std::shared_ptr<prometheus::Registry> registry);
  ~MetricsEndpoint();
  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  int port() const;
  // HOST:PORT a scraper can reach: the bound address, or the host name when
  // bound to every interface.
  std::string address() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe::http
