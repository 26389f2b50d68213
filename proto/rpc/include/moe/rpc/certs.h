// A certificate authority for a cluster's control-plane TLS
// (docs/control-plane.md#tls): `moectl cluster up` makes one in its state
// directory and issues the agent's, the daemons' and moectl's certificates with
// it; `moectl tls create` does the same for a real cluster. ECDSA P-256, SHA-256,
// every leaf good for server and client authentication (mutual TLS).
#pragma once

#include <string>
#include <vector>

namespace moe::rpc {

struct Pem {
  std::string cert;
  std::string key;
};

class CertAuthority {
 public:
  // A new self-signed CA named `name`, valid for `days`.
  static CertAuthority create(const std::string& name, int days);
  // The CA in these PEM texts; throws moe::InvalidArgument when they do not parse.
  static CertAuthority load(const Pem& pem);
  // The CA kept in DIR (ca.pem, ca.key), or a new one named `name` written there;
  // `made` (optional) tells which.
  static CertAuthority in_folder(const std::string& dir, const std::string& name, int days, bool* made = nullptr);
  const Pem& pem() const { return pem_; }
  // A certificate for `name` whose subjectAltName lists `hosts` (IP addresses
  // and DNS names), valid for `days`.
  Pem issue(const std::string& name, const std::vector<std::string>& hosts, int days) const;

 private:
  Pem pem_;
};

// Writes DIR/NAME.pem and DIR/NAME.key (mode 0600), each atomically.
void write_pem(const std::string& dir, const std::string& name, const Pem& pem);

}  // namespace moe::rpc
