// TLS for the control plane (docs/control-plane.md#tls): the OpenSSL contexts
// built from TlsFiles, and the words for a failed handshake. Private to proto/rpc.
#pragma once

#include <boost/asio/ssl.hpp>
#include <string>

#include "moe/rpc/asio.h"
#include "moe/rpc/client.h"

namespace moe::rpc::detail {

namespace ssl = boost::asio::ssl;

// TLS 1.3 only, the peer's certificate required and verified against files.ca.
// Throws moe::InvalidArgument naming the file that cannot be used.
ssl::context client_context(const TlsFiles& files);
ssl::context server_context(const TlsFiles& files);

// A handshake error as a user can act on it: what OpenSSL said, and which
// side's files to look at.
std::string handshake_failure(const boost::system::error_code& ec, bool server_side);

// The first byte of a TLS connection (a handshake record); a plain frame's
// length prefix starts with 0 for any frame under 16 MiB.
inline constexpr unsigned char kTlsHandshakeRecord = 0x16;

}  // namespace moe::rpc::detail
