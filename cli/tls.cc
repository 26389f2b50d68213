// moectl tls create (docs/control-plane.md#tls): the files a real cluster's
// control plane needs, from a CA kept in the same folder.
#include <filesystem>
#include <ostream>

#include "moe/ctl/ctl.h"
#include "moe/rpc/certs.h"

namespace moe::ctl {

namespace fs = std::filesystem;

int tls_create(const TlsCreateOptions& o, std::ostream& out, std::ostream& err) {
  try {
    if (o.names.empty()) throw InvalidArgument("--name: give at least one (agent, node0, moectl, ...)");
    if (o.days < 1) throw InvalidArgument("--days must be >= 1");
    const fs::path dir = o.dir;
    bool made = false;
    const rpc::CertAuthority ca = rpc::CertAuthority::in_folder(dir.string(), "moed cluster CA", 3650, &made);
    if (made)
      out << "made the CA " << (dir / "ca.pem").string() << " (keep " << (dir / "ca.key").string() << " private)\n";
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
