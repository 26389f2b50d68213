// moectl tls create (docs/control-plane.md#tls): the files a real cluster's
// control plane needs, from a CA kept in the same folder.
#include <filesystem>
#include <ostream>

#include "moe/base/file.h"
#include "moe/ctl/ctl.h"
#include "moe/rpc/certs.h"

namespace moe::ctl {

namespace fs = std::filesystem;

int tls_create(const TlsCreateOptions& o, std::ostream& out, std::ostream& err) {
  try {
    if (o.names.empty()) throw InvalidArgument("--name: give at least one (agent, node0, moectl, ...)");
    if (o.days < 1) throw InvalidArgument("--days must be >= 1");
    const fs::path dir = o.dir, ca_cert = dir / "ca.pem", ca_key = dir / "ca.key";
    const bool existing = fs::exists(ca_cert) && fs::exists(ca_key);
    const rpc::CertAuthority ca =
        existing ? rpc::CertAuthority::load({read_file(ca_cert.string()), read_file(ca_key.string())})
                 : rpc::CertAuthority::create("moed cluster CA", 3650);
    if (!existing) {
      rpc::write_pem(dir.string(), "ca", ca.pem());
      out << "made the CA " << ca_cert.string() << " (keep " << ca_key.string() << " private)\n";
    }
    for (const std::string& name : o.names) {
      if (name.empty() || name.find('/') != std::string::npos || name == "ca")
        throw InvalidArgument("--name '" + name + "': a plain file name other than 'ca'");
      rpc::write_pem(dir.string(), name, ca.issue(name, o.hosts, o.days));
      out << "issued " << (dir / (name + ".pem")).string() << " and " << name << ".key for";
      for (const std::string& h : o.hosts) out << " " << h;
      out << (o.hosts.empty() ? " no host (a client only)\n" : "\n");
    }
    return kExitOk;
  } catch (const std::exception& e) {
    err << "moectl: tls create: " << e.what() << "\n";
    return kExitUsage;
  }
}

}  // namespace moe::ctl
