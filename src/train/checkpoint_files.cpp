// The file side of checkpoints: durable atomic writes, checkpoint naming, the newest checkpoint of
// a directory, rotation, and the removal of temporaries left by killed processes.
//
// Note [Atomic checkpoints] (flame/checkpoint.h) in practice: the data goes to
// "<dir>/.<name>.flame-tmp.<pid>.<n>", is fsync'ed, then rename(2) replaces "<dir>/<name>" in one
// step (POSIX: another process sees the old or the new file, never a mix), and the directory is
// fsync'ed so the rename itself survives a power loss. Until the rename the old file is untouched.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "flame/checkpoint.h"
#include "flame/error.h"
#include "flame/io/safetensors.h"
#include "src/train/checkpoint_detail.h"

namespace flame {

namespace {

constexpr const char* kTmpTag = ".flame-tmp.";

std::string errno_text() { return std::strerror(errno); }

std::pair<std::string, std::string> split_path(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

void fsync_path(const std::string& path, bool directory, const char* op) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  FLAME_CHECK(fd >= 0, op, "cannot open '", path, "' to sync it: ", errno_text());
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  errno = err;
  // Some file systems cannot sync a directory (EINVAL); the rename is then as durable as they allow.
  if (rc != 0 && directory && (err == EINVAL || err == EOPNOTSUPP)) return;
  FLAME_CHECK(rc == 0, op, "fsync of '", path, "' failed: ", errno_text());
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (dirent* e = ::readdir(d)) {
    const std::string n = e->d_name;
    if (n != "." && n != "..") names.push_back(n);
  }
  ::closedir(d);
  return names;
}

// "<prefix>-<digits>.safetensors" -> step; -1 when the name is not a checkpoint of `prefix`.
int64_t step_of(const std::string& name, const std::string& prefix) {
  const std::string head = prefix + "-";
  const std::string tail = ".safetensors";
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return -1;
  }
  const std::string digits = name.substr(head.size(), name.size() - head.size() - tail.size());
  if (digits.empty() || digits.size() > 18 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return -1;
  }
  return std::stoll(digits);
}

// Checkpoints of `prefix` in `dir`, newest (highest step) first.
std::vector<std::pair<int64_t, std::string>> checkpoints_of(const std::string& dir, const std::string& prefix) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const std::string& n : list_dir(dir)) {
    const int64_t s = step_of(n, prefix);
    if (s >= 0) out.emplace_back(s, dir + "/" + n);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace

namespace checkpoint_detail {

void atomic_save(const std::string& path, const StateDict& host, const io::Metadata& meta) {
  static std::atomic<uint64_t> counter{0};
  const auto [dir, base] = split_path(path);
  FLAME_CHECK(!base.empty(), "Checkpoint::save", "'", path, "' names a directory, not a file");
  const std::string tmp = dir + "/." + base + kTmpTag + std::to_string(static_cast<long>(::getpid())) + "." +
                          std::to_string(counter.fetch_add(1));
  try {
    io::save_safetensors(tmp, host, meta);
    fsync_path(tmp, false, "Checkpoint::save");
    FLAME_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "Checkpoint::save", "cannot rename '", tmp, "' to '",
                path, "': ", errno_text());
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  fsync_path(dir, true, "Checkpoint::save");
}

}  // namespace checkpoint_detail

std::string checkpoint_path(const std::string& dir, int64_t step, const std::string& prefix) {
  FLAME_CHECK(step >= 0, "checkpoint_path", "step ", step, " is negative");
  char digits[32];
  std::snprintf(digits, sizeof digits, "%010lld", static_cast<long long>(step));
  return dir + "/" + prefix + "-" + digits + ".safetensors";
}

std::optional<std::string> latest_checkpoint(const std::string& dir, const std::string& prefix) {
  for (const auto& [step, path] : checkpoints_of(dir, prefix)) {
    try {
      (void)read_checkpoint_info(path);
      return path;
    } catch (const Error&) {
      // Not readable (not written by a save, or damaged since): try the next older one.
    }
  }
  return std::nullopt;
}

std::vector<std::string> keep_last_checkpoints(const std::string& dir, int keep_last, const std::string& prefix) {
  std::vector<std::string> removed;
  if (keep_last <= 0) return removed;
  const auto all = checkpoints_of(dir, prefix);
  for (std::size_t i = static_cast<std::size_t>(keep_last); i < all.size(); ++i) {
    if (std::remove(all[i].second.c_str()) == 0) removed.push_back(all[i].second);
  }
  if (!removed.empty()) fsync_path(dir, true, "keep_last_checkpoints");
  return removed;
}

std::vector<std::string> remove_stale_temporaries(const std::string& dir) {
  std::vector<std::string> removed;
  for (const std::string& n : list_dir(dir)) {
    const std::size_t at = n.find(kTmpTag);
    if (n.empty() || n[0] != '.' || at == std::string::npos) continue;
    std::size_t p = at + std::strlen(kTmpTag);
    long pid = 0;
    std::size_t digits = 0;
    while (p < n.size() && n[p] >= '0' && n[p] <= '9' && digits < 12) {
      pid = pid * 10 + (n[p++] - '0');
      ++digits;
    }
    if (digits == 0 || pid == static_cast<long>(::getpid())) continue;
    // A process that still runs (or whose id was reused) keeps its file.
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    const std::string path = dir + "/" + n;
    if (std::remove(path.c_str()) == 0) removed.push_back(path);
  }
  return removed;
}

std::string Checkpoint::save_rotating(const std::string& dir, int keep_last, const std::string& prefix) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  FLAME_CHECK(!ec, "Checkpoint::save_rotating", "cannot create directory '", dir, "': ", ec.message());
  const std::string path = checkpoint_path(dir, progress_.step, prefix);
  save(path);
  keep_last_checkpoints(dir, keep_last, prefix);
  remove_stale_temporaries(dir);
  return path;
}

}  // namespace flame
