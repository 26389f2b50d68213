// Bootstrap: how ranks swap the bytes they need to connect (UCX worker addresses).
// Each rank contributes one blob and gets every rank's blob, indexed by rank. The
// coordinator relays them in a cluster; tests use TcpRendezvous on loopback.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace moe::transport {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;
  virtual std::vector<std::string> all_gather(const std::string& mine) = 0;
};

// A one-shot rendezvous server: waits for `size` clients, each sending (rank, blob),
// then answers every client with all blobs. Runs on its own thread.
class TcpRendezvousServer {
 public:
  // Binds 127.0.0.1 (or `host`) on an ephemeral port.
  explicit TcpRendezvousServer(int size, std::chrono::milliseconds timeout = std::chrono::seconds(30),
                               const std::string& host = "127.0.0.1");
  ~TcpRendezvousServer();
  int port() const { return port_; }
  // Blocks until the exchange finished; throws moe::Error if it failed (timeout,
  // a duplicate or out-of-range rank, a client that hung up).
  void wait();

 private:
  void serve();
  int size_;
  std::chrono::milliseconds timeout_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::thread thread_;
  std::string error_;
};

// The client side: one all_gather, through the server at host:port.
class TcpBootstrap final : public Bootstrap {
 public:
  TcpBootstrap(std::string host, int port, int rank, int size,
               std::chrono::milliseconds timeout = std::chrono::seconds(30));
  std::vector<std::string> all_gather(const std::string& mine) override;

 private:
  std::string host_;
  int port_, rank_, size_;
  std::chrono::milliseconds timeout_;
};

// Carries one extra blob from rank 0 (a CUDA job's NCCL unique id) in the same
// round of `inner` as every rank's own bytes (the UCX worker addresses), so the
// agent relays both at once. Each rank sends [u32 length | its bytes | extra],
// the extra part empty except on rank 0.
class RootBlobBootstrap final : public Bootstrap {
 public:
  // root_blob: the extra bytes on rank 0 (ignored elsewhere).
  RootBlobBootstrap(Bootstrap& inner, int rank, std::string root_blob);
  // Every rank's own bytes, as inner would return them without the extra blob.
  std::vector<std::string> all_gather(const std::string& mine) override;
  // Rank 0's extra blob, once all_gather returned (throws before).
  const std::string& root_blob() const;

 private:
  Bootstrap& inner_;
  int rank_;
  std::string root_blob_;
  bool gathered_ = false;
};

}  // namespace moe::transport
