// The control plane over TLS (docs/control-plane.md#tls): mutual TLS between
// clients and servers whose certificates one CA signed, the token still checked
// inside; and every way to get it wrong refused with a message that says which:
// a plain client, a client of another CA, a certificate that does not name the
// host, a TLS client at a plain server, files missing or given alone.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "moe/base/check.h"
#include "moe/rpc/certs.h"
#include "moe/rpc/server.h"

namespace moe::test {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;
using rpc::RpcError;
using rpc::TlsFiles;

// A folder of certificates: ca (and its agent/client leaves) and a stranger CA's.
class Certs {
 public:
  Certs() : dir_(fs::temp_directory_path() / ("moe_tls_test_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    const auto ca = rpc::CertAuthority::create("test CA", 1);
    rpc::write_pem(dir_, "ca", ca.pem());
    rpc::write_pem(dir_, "server", ca.issue("server", {"127.0.0.1", "localhost"}, 1));
    rpc::write_pem(dir_, "client", ca.issue("client", {}, 1));
    rpc::write_pem(dir_, "elsewhere", ca.issue("elsewhere", {"10.9.9.9", "other.example"}, 1));
    const auto stranger = rpc::CertAuthority::create("stranger CA", 1);
    rpc::write_pem(dir_, "stranger-ca", stranger.pem());
    rpc::write_pem(dir_, "stranger", stranger.issue("stranger", {"127.0.0.1"}, 1));
  }
  ~Certs() { fs::remove_all(dir_); }
  TlsFiles files(const std::string& leaf, const std::string& ca = "ca") const {
    return {path(leaf + ".pem"), path(leaf + ".key"), path(ca + ".pem")};
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
};

const Certs& certs() {
  static const Certs c;
  return c;
}

class Server {
 public:
  explicit Server(const TlsFiles& tls, const std::string& token = "sesame") {
    rpc::ServerOptions o;
    o.token = token;
    o.role = "test-server";
    o.tls = tls;
    server_ = std::make_unique<rpc::RpcServer>(io_, o, [](const v1::Envelope& req, const rpc::RequestContext&) -> rpc::awaitable<v1::Envelope> {
      v1::Envelope reply;
      reply.mutable_job()->set_job_id(req.get_job().job_id());
      co_return reply;
    });
    thread_ = std::thread([this] {
      auto guard = rpc::asio::make_work_guard(io_);
      io_.run();
    });
  }
  ~Server() {
    rpc::asio::post(io_, [this] { server_->stop(); });
    io_.stop();
    thread_.join();
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(server_->port()); }

 private:
  rpc::asio::io_context io_;
  std::unique_ptr<rpc::RpcServer> server_;
  std::thread thread_;
};

// get_job("x") through a client with these files; the reply's id, or the error.
std::string call(const std::string& address, const TlsFiles& tls, const std::string& token = "sesame") {
  auto o = rpc::ClientOptions::make(address, token, "test-client", "test");
  o.tls = tls;
  rpc::RpcClient c(o);
  v1::Envelope req;
  req.mutable_get_job()->set_job_id("x");
  try {
    return c.call(req, 5s).job().job_id();
  } catch (const RpcError& e) {
    return e.what();
  }
}

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
}

TEST(Tls, MutualTlsCallsWorkAndTheTokenIsStillChecked) {
  Server s(certs().files("server"));
  EXPECT_EQ(call(s.address(), certs().files("client")), "x");
  expect_contains(call(s.address(), certs().files("client"), "wrong"), "bad cluster token");
  // "localhost" is in the server's certificate as well.
  EXPECT_EQ(call("localhost:" + s.address().substr(s.address().find(':') + 1), certs().files("client")), "x");
}

TEST(Tls, APlainClientIsToldTheServerRequiresTls) {
  Server s(certs().files("server"));
  const std::string why = call(s.address(), {});
  expect_contains(why, "requires TLS");
  expect_contains(why, "--tls-ca");
}

TEST(Tls, AClientThatTrustsAnotherCaRefusesTheServer) {
  Server s(certs().files("server"));
  const std::string why = call(s.address(), certs().files("stranger", "stranger-ca"));
  expect_contains(why, "TLS with " + s.address() + " failed");
  expect_contains(why, "certificate verify failed");
  expect_contains(why, "not signed by --tls-ca");
}

TEST(Tls, TheServerRefusesAClientCertificateOfAnotherCa) {
  Server s(certs().files("server"));
  // Trusts the right CA, but shows a stranger's certificate.
  const TlsFiles tls{certs().path("stranger.pem"), certs().path("stranger.key"), certs().path("ca.pem")};
  const std::string why = call(s.address(), tls);
  expect_contains(why, "TLS with " + s.address() + " failed");
  expect_contains(why, "the server refused this certificate");
}

TEST(Tls, AServerCertificateThatDoesNotNameTheHostIsRefused) {
  Server s(certs().files("elsewhere"));
  const std::string why = call(s.address(), certs().files("client"));
  expect_contains(why, "certificate verify failed");
  expect_contains(why, "does not name the host");
}

TEST(Tls, ATlsClientAtAPlainServerIsToldItDoesNotSpeakTls) {
  Server s({});
  const std::string why = call(s.address(), certs().files("client"));
  expect_contains(why, "does not speak TLS");
}

TEST(Tls, MissingFilesAndFlagsGivenAloneAreNamed) {
  auto refused = [](const TlsFiles& f, const std::string& part) {
    try {
      rpc::RpcClient c(rpc::ClientOptions{"127.0.0.1:1", "", f});
      ADD_FAILURE() << "accepted";
    } catch (const InvalidArgument& e) {
      expect_contains(e.what(), part);
    }
  };
  TlsFiles f = certs().files("client");
  f.ca.clear();
  refused(f, "TLS needs --tls-ca too");
  f = certs().files("client");
  f.key = "/nonexistent.key";
  refused(f, "--tls-key: /nonexistent.key is not a readable file");
  f = certs().files("client");
  f.key = certs().path("server.key");
  refused(f, "is not the key of");
  f = certs().files("client");
  f.ca = certs().path("client.key");
  refused(f, "--tls-ca: " + certs().path("client.key"));
}

TEST(Tls, KeysAreWrittenReadableByTheOwnerOnly) {
  struct stat st{};
  ASSERT_EQ(::stat(certs().path("client.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  ASSERT_EQ(::stat(certs().path("client.pem").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0644u);
}

}  // namespace
}  // namespace moe::test
