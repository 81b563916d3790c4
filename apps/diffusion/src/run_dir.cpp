#include "run_dir.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <system_error>

#include "cli_checks.h"

namespace flame_diffusion {

namespace fs = std::filesystem;

// Note [Run directories]
// A run directory holds a run when it has any file the trainer writes: a checkpoint, loss.csv (or
// a rank's loss.rank<N>.csv), loss.png, samples.png or a finetune's lora.safetensors. Training into
// it afresh would mix two runs (the CSV cut to the new rows, the PNGs replaced, the new checkpoint
// rotated away by the old ones' higher steps, and the next --resume continuing the old run), so
// `train` and `finetune` refuse unless --resume (continue it) or --overwrite (start afresh).
// --overwrite removes exactly the files run_files lists, by name pattern; anything else in the
// folder (the user's notes, other programs' outputs) stays.

namespace {

bool digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// ckpt-<10 digits>.safetensors, as Checkpoint::save_rotating names them.
bool is_checkpoint_name(const std::string& n) {
  const std::string pre = "ckpt-", post = ".safetensors";
  if (!starts_with(n, pre) || !ends_with(n, post) || n.size() != pre.size() + 10 + post.size()) return false;
  return digits(n.substr(pre.size(), 10));
}

// The temporaries of Checkpoint::save: .<name>.flame-tmp.<pid>.<n>.
bool is_checkpoint_temporary(const std::string& n) {
  const std::size_t at = n.find(".safetensors.flame-tmp.");
  return starts_with(n, ".") && at != std::string::npos && is_checkpoint_name(n.substr(1, at - 1 + 12));
}

// The top-level files of a run (and their write temporaries <name>.tmp).
bool is_top_level_run_file(const std::string& n) {
  std::string base = n;
  if (ends_with(base, ".tmp")) base = base.substr(0, base.size() - 4);
  if (base == "loss.csv" || base == "loss.png" || base == "samples.png" || base == "lora.safetensors") return true;
  if (starts_with(base, "loss.rank") && ends_with(base, ".csv")) return digits(base.substr(9, base.size() - 13));
  return false;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::error_code ec2;
    if (e.is_regular_file(ec2)) out.push_back(e.path().filename().string());
  }
  return out;
}

}  // namespace

std::vector<std::string> run_files(const std::string& out) {
  std::vector<std::string> files;
  for (const std::string& n : names_in(out))
    if (is_top_level_run_file(n)) files.push_back(n);
  for (const std::string& n : names_in(fs::path(out) / "checkpoints"))
    if (is_checkpoint_name(n) || is_checkpoint_temporary(n)) files.push_back("checkpoints/" + n);
  std::sort(files.begin(), files.end());
  return files;
}

void prepare_run_dir(const std::string& out, bool resume, bool overwrite, const std::string& command) {
  if (resume && overwrite) throw UsageError(command + ": --resume continues the run in " + out + ", --overwrite removes it: pass one of them");
  const std::vector<std::string> files = run_files(out);
  if (files.empty() || resume) return;
  std::string listed;
  const std::size_t shown = std::min<std::size_t>(files.size(), 6);
  for (std::size_t i = 0; i < shown; ++i) listed += (i ? ", " : "") + files[i];
  if (files.size() > shown) listed += " and " + std::to_string(files.size() - shown) + " more";
  if (!overwrite) {
    throw UsageError(command + ": " + out + " already holds a run (" + listed +
                     "); pass --resume to continue it, --overwrite to remove it and start afresh (only those files "
                     "are removed), or choose another --out");
  }
  for (const std::string& f : files) {
    std::error_code ec;
    fs::remove(fs::path(out) / f, ec);
    if (ec) throw std::runtime_error("--overwrite: cannot remove " + (fs::path(out) / f).string() + ": " + ec.message());
  }
  std::error_code ec;
  const fs::path ckdir = fs::path(out) / "checkpoints";
  if (fs::is_directory(ckdir, ec) && fs::is_empty(ckdir, ec)) fs::remove(ckdir, ec);
  std::fprintf(stderr, "%s: --overwrite: removed %zu files of the previous run in %s (%s)\n", command.c_str(),
               files.size(), out.c_str(), listed.c_str());
}

std::vector<std::string> checkpoint_files(const std::string& checkpoints_dir) {
  std::vector<std::string> names;
  for (const std::string& n : names_in(checkpoints_dir))
    if (is_checkpoint_name(n)) names.push_back(n);
  std::sort(names.begin(), names.end(), std::greater<>());  // 10-digit steps: name order is step order
  std::vector<std::string> paths;
  for (const std::string& n : names) paths.push_back((fs::path(checkpoints_dir) / n).string());
  return paths;
}

}  // namespace flame_diffusion
