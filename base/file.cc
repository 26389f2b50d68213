#include "moe/base/file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "moe/base/check.h"

namespace moe {
namespace {

std::string why() { return std::strerror(errno); }

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    MOE_CHECK(n > 0, path, ": write failed: ", why());
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void write_file_atomically(const std::string& path, const std::string& contents, unsigned mode) {
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());  // a leftover keeps its old mode otherwise
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, static_cast<mode_t>(mode));
  MOE_CHECK(fd >= 0, tmp, ": cannot create: ", why());
  try {
    write_all(fd, contents, tmp);
    MOE_CHECK(::fsync(fd) == 0, tmp, ": fsync failed: ", why());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  MOE_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, path, ": rename failed: ", why());
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  MOE_CHECK(in.good(), path, ": cannot open: ", why());
  std::stringstream ss;
  ss << in.rdbuf();
  MOE_CHECK(!in.bad(), path, ": read failed");
  return ss.str();
}

}  // namespace moe
