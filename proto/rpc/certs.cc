#include "moe/rpc/certs.h"

#include <openssl/bio.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <filesystem>
#include <memory>

#include "moe/base/check.h"
#include "moe/base/file.h"

namespace moe::rpc {
namespace {

template <typename T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using Key = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using Cert = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using Bio = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;

void ok(bool good, const char* step) {
  if (good) return;
  char buf[256] = {};
  ERR_error_string_n(ERR_get_error(), buf, sizeof buf);
  throw Error(std::string("certificate: ") + step + " failed: " + buf);
}

std::string text_of(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

std::string key_pem(EVP_PKEY* key) {
  Bio bio(BIO_new(BIO_s_mem()));
  ok(PEM_write_bio_PrivateKey(bio.get(), key, nullptr, nullptr, 0, nullptr, nullptr) == 1, "writing a key");
  return text_of(bio.get());
}

std::string cert_pem(X509* cert) {
  Bio bio(BIO_new(BIO_s_mem()));
  ok(PEM_write_bio_X509(bio.get(), cert) == 1, "writing a certificate");
  return text_of(bio.get());
}

Key new_key() {
  Key key(EVP_EC_gen("P-256"));
  ok(key != nullptr, "making a P-256 key");
  return key;
}

void add_ext(X509* cert, X509* issuer, int nid, const std::string& value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, issuer, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value.c_str());
  ok(ext != nullptr, ("extension " + value).c_str());
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

// The parts every certificate has: a random serial, the validity window (from a
// minute ago, for clocks a little apart), the subject, the public key.
Cert new_cert(const std::string& name, EVP_PKEY* key, int days) {
  Cert cert(X509_new());
  ok(X509_set_version(cert.get(), 2) == 1, "version");
  std::unique_ptr<BIGNUM, Deleter<BIGNUM, BN_free>> serial(BN_new());
  ok(BN_rand(serial.get(), 63, BN_RAND_TOP_ANY, BN_RAND_BOTTOM_ANY) == 1, "serial");
  BN_to_ASN1_INTEGER(serial.get(), X509_get_serialNumber(cert.get()));
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -60);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), static_cast<long>(days) * 24 * 3600);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(cert.get()), "CN", MBSTRING_UTF8,
                             reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1, 0);
  ok(X509_set_pubkey(cert.get(), key) == 1, "public key");
  return cert;
}

Key parse_key(const std::string& pem) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Key key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (!key) throw InvalidArgument("the CA key is not a PEM private key");
  return key;
}

Cert parse_cert(const std::string& pem) {
  Bio bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  Cert cert(PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (!cert) throw InvalidArgument("the CA certificate is not a PEM certificate");
  return cert;
}

bool is_ip(const std::string& host) {
  return host.find_first_not_of("0123456789.") == std::string::npos || host.find(':') != std::string::npos;
}

}  // namespace

CertAuthority CertAuthority::create(const std::string& name, int days) {
  const Key key = new_key();
  const Cert cert = new_cert(name, key.get(), days);
  ok(X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get())) == 1, "issuer");
  add_ext(cert.get(), cert.get(), NID_basic_constraints, "critical,CA:TRUE,pathlen:0");
  add_ext(cert.get(), cert.get(), NID_key_usage, "critical,keyCertSign,cRLSign");
  add_ext(cert.get(), cert.get(), NID_subject_key_identifier, "hash");
  ok(X509_sign(cert.get(), key.get(), EVP_sha256()) > 0, "signing the CA");
  CertAuthority ca;
  ca.pem_ = {cert_pem(cert.get()), key_pem(key.get())};
  return ca;
}

CertAuthority CertAuthority::load(const Pem& pem) {
  parse_cert(pem.cert);
  parse_key(pem.key);
  CertAuthority ca;
  ca.pem_ = pem;
  return ca;
}

CertAuthority CertAuthority::in_folder(const std::string& dir, const std::string& name, int days, bool* made) {
  const std::filesystem::path cert = std::filesystem::path(dir) / "ca.pem", key = std::filesystem::path(dir) / "ca.key";
  const bool existing = std::filesystem::exists(cert) && std::filesystem::exists(key);
  if (made) *made = !existing;
  if (existing) return load({read_file(cert.string()), read_file(key.string())});
  CertAuthority ca = create(name, days);
  write_pem(dir, "ca", ca.pem());
  return ca;
}

Pem CertAuthority::issue(const std::string& name, const std::vector<std::string>& hosts, int days) const {
  const Cert ca_cert = parse_cert(pem_.cert);
  const Key ca_key = parse_key(pem_.key);
  const Key key = new_key();
  const Cert cert = new_cert(name, key.get(), days);
  ok(X509_set_issuer_name(cert.get(), X509_get_subject_name(ca_cert.get())) == 1, "issuer");
  add_ext(cert.get(), ca_cert.get(), NID_basic_constraints, "critical,CA:FALSE");
  add_ext(cert.get(), ca_cert.get(), NID_key_usage, "critical,digitalSignature");
  add_ext(cert.get(), ca_cert.get(), NID_ext_key_usage, "serverAuth,clientAuth");
  add_ext(cert.get(), ca_cert.get(), NID_authority_key_identifier, "keyid:always");
  std::string san;
  for (const std::string& h : hosts) san += (san.empty() ? "" : ",") + std::string(is_ip(h) ? "IP:" : "DNS:") + h;
  if (!san.empty()) add_ext(cert.get(), ca_cert.get(), NID_subject_alt_name, san);
  ok(X509_sign(cert.get(), ca_key.get(), EVP_sha256()) > 0, "signing");
  return {cert_pem(cert.get()), key_pem(key.get())};
}

void write_pem(const std::string& dir, const std::string& name, const Pem& pem) {
  std::filesystem::create_directories(dir);
  write_file_atomically((std::filesystem::path(dir) / (name + ".key")).string(), pem.key, 0600);
  write_file_atomically((std::filesystem::path(dir) / (name + ".pem")).string(), pem.cert, 0644);
}

}  // namespace moe::rpc
