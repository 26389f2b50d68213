#include "tls.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include <filesystem>

#include "moe/base/check.h"

namespace moe::rpc {

void TlsFiles::check() const {
  if (!enabled()) return;
  const std::pair<const char*, const std::string*> parts[] = {{"--tls-cert", &cert}, {"--tls-key", &key}, {"--tls-ca", &ca}};
  for (const auto& [flag, path] : parts) {
    if (path->empty()) throw InvalidArgument(std::string("TLS needs ") + flag + " too (--tls-cert, --tls-key and --tls-ca go together)");
    if (!std::filesystem::is_regular_file(*path)) throw InvalidArgument(std::string(flag) + ": " + *path + " is not a readable file");
  }
}

namespace detail {
namespace {

void load(ssl::context& ctx, const TlsFiles& files) {
  files.check();
  ctx.set_options(ssl::context::no_sslv2 | ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1 |
                  ssl::context::no_tlsv1_2);
  auto use = [](const char* flag, const std::string& path, auto&& fn) {
    boost::system::error_code ec;
    fn(ec);
    if (ec) throw InvalidArgument(std::string(flag) + ": " + path + ": " + ec.message());
  };
  use("--tls-cert", files.cert, [&](auto& ec) { ctx.use_certificate_chain_file(files.cert, ec); });
  use("--tls-key", files.key, [&](auto& ec) {
    ctx.use_private_key_file(files.key, ssl::context::pem, ec);
    if (ERR_GET_REASON(static_cast<unsigned long>(ec.value())) == X509_R_KEY_VALUES_MISMATCH)
      throw InvalidArgument("--tls-key: " + files.key + " is not the key of " + files.cert);
  });
  use("--tls-ca", files.ca, [&](auto& ec) { ctx.load_verify_file(files.ca, ec); });
  if (SSL_CTX_check_private_key(ctx.native_handle()) != 1)
    throw InvalidArgument("--tls-key: " + files.key + " is not the key of " + files.cert);
}

}  // namespace

ssl::context client_context(const TlsFiles& files) {
  ssl::context ctx(ssl::context::tls_client);
  load(ctx, files);
  ctx.set_verify_mode(ssl::verify_peer);
  return ctx;
}

ssl::context server_context(const TlsFiles& files) {
  ssl::context ctx(ssl::context::tls_server);
  load(ctx, files);
  ctx.set_verify_mode(ssl::verify_peer | ssl::verify_fail_if_no_peer_cert);
  return ctx;
}

std::string handshake_failure(const boost::system::error_code& ec, bool server_side) {
  std::string why = ec.message();
  if (ec.category() == boost::asio::error::get_ssl_category()) {
    const int reason = ERR_GET_REASON(static_cast<unsigned long>(ec.value()));
    if (reason == SSL_R_WRONG_VERSION_NUMBER || reason == SSL_R_PACKET_LENGTH_TOO_LONG)
      return why + ": the peer does not speak TLS (started with --plaintext?)";
    if (reason == SSL_R_CERTIFICATE_VERIFY_FAILED)
      return why + (server_side ? ": the client's certificate is not signed by this --tls-ca"
                                : ": the server's certificate is not signed by --tls-ca, or does not name the host");
    if (reason == SSL_R_PEER_DID_NOT_RETURN_A_CERTIFICATE)
      return why + ": the client gave no certificate (--tls-cert, --tls-key)";
    if (reason == SSL_R_TLSV13_ALERT_CERTIFICATE_REQUIRED)
      return why + ": the server requires a client certificate (--tls-cert, --tls-key)";
    if (reason == SSL_R_TLSV1_ALERT_UNKNOWN_CA || reason == SSL_R_SSLV3_ALERT_BAD_CERTIFICATE)
      return why + (server_side ? ": the client refused this server's certificate (not signed by its CA)"
                                : ": the server refused this certificate (not signed by its CA)");
  }
  return why;
}

}  // namespace detail
}  // namespace moe::rpc
