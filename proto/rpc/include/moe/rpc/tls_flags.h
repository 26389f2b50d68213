// The TLS flags moe-agent, moed and moectl share (docs/control-plane.md#tls).
// Header-only over CLI11, for the mains.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "moe/base/check.h"
#include "moe/rpc/client.h"

namespace moe::rpc {

struct TlsFlags {
  TlsFiles files;
  bool plaintext = false;

  // A server (moe-agent, moed) also gets --plaintext, the only way it runs without TLS.
  void add(CLI::App& app, bool server) {
    app.add_option("--tls-cert", files.cert, "PEM certificate of this process, signed by --tls-ca")->envname("MOE_TLS_CERT");
    app.add_option("--tls-key", files.key, "PEM private key of --tls-cert")->envname("MOE_TLS_KEY");
    app.add_option("--tls-ca", files.ca, "PEM certificate of the CA that signs every peer's")->envname("MOE_TLS_CA");
    if (server)
      app.add_flag("--plaintext", plaintext, "no TLS: plain TCP to and from this process, on a network you trust only");
  }

  // The files a server uses: TLS, or nothing when --plaintext was asked for.
  // Throws moe::InvalidArgument when it was given neither or both.
  TlsFiles for_server(const std::string& who) const {
    if (plaintext && files.enabled()) throw InvalidArgument(who + ": give --plaintext or the --tls-* files, not both");
    if (!plaintext && !files.enabled())
      throw InvalidArgument(who + " needs --tls-cert, --tls-key and --tls-ca (`moectl tls create` makes them), or "
                                  "--plaintext on a network you trust");
    files.check();
    return files;
  }
};

}  // namespace moe::rpc
