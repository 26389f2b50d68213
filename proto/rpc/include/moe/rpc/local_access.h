// How a program on the machine reaches a local cluster (`moectl cluster up`)
// from its state directory (docs/cli.md): the agent's address, the token and
// the certificates for mutual TLS that `cluster up` wrote there. moectl and the
// expert service's client read it the same way.
#pragma once

#include <string>

#include "moe/rpc/client.h"

namespace moe::rpc {

struct LocalAccess {
  std::string agent;  // empty: the directory has no agent_address (no cluster up)
  std::string token;  // empty: no token file
  TlsFiles tls;       // empty: a --plaintext cluster
};

// $MOE_STATE_DIR, else $HOME/.local/state/moed (`cluster up`'s default).
std::string default_state_dir();
// What `state_dir` holds; a field stays empty where its file is absent.
// `cert_name`: whose certificate in tls/ (moectl's: the operator's client).
LocalAccess local_access(const std::string& state_dir, const std::string& cert_name = "moectl");

}  // namespace moe::rpc
