// Image/caption data sets: scanning, buckets, item transforms and the bucketed loader (image_dataset.h).
#include "image_dataset.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "image_decode.h"

namespace flame_diffusion {
namespace fs = std::filesystem;
namespace {

double uniform01(flame::HostRng& rng) { return static_cast<double>(rng.next() >> 11) * 0x1.0p-53; }

template <class T>
void shuffle_in_place(std::vector<T>& v, flame::HostRng& rng) {
  for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rng.below(i)]);
}

std::string trim(const std::string& s) {
  const char* ws = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

bool is_image_name(const fs::path& p) {
  const std::string ext = lower(p.extension().string());
  return ext == ".jpg" || ext == ".jpeg" || ext == ".png" || ext == ".webp";
}

// The whole caption file, trimmed, line breaks as spaces.
std::string read_caption(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string text = ss.str();
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\r' || text[i] == '\n') {
      if (!out.empty() && out.back() != ' ') out.push_back(' ');
      continue;
    }
    out.push_back(text[i]);
  }
  return trim(out);
}

std::string size_text(int w, int h) { return std::to_string(w) + "x" + std::to_string(h); }

}  // namespace

void check_dataset_config(const DatasetConfig& c, bool require_sources) {
  auto fail = [](const std::string& msg) { throw std::runtime_error("dataset: " + msg); };
  if (require_sources && c.folders.empty() && c.manifest.empty())
    fail("no images to train on: set dataset.folders (folders of images with captions) or dataset.manifest (a JSONL file)");
  if (!c.folder_repeats.empty() && c.folder_repeats.size() != c.folders.size())
    fail("dataset.folder_repeats has " + std::to_string(c.folder_repeats.size()) + " entries for " +
         std::to_string(c.folders.size()) + " dataset.folders: give one per folder (0: from the folder's name) or none");
  for (int64_t r : c.folder_repeats)
    if (r < 0) fail("dataset.folder_repeats: " + std::to_string(r) + " is negative (0 means: from the folder's name)");
  if (c.repeats < 1) fail("dataset.repeats = " + std::to_string(c.repeats) + ": must be >= 1");
  if (c.bucket_step < 8) fail("dataset.bucket_step = " + std::to_string(c.bucket_step) + ": must be >= 8");
  if (c.resolution % c.bucket_step != 0)
    fail("dataset.resolution = " + std::to_string(c.resolution) + " is not a multiple of dataset.bucket_step = " +
         std::to_string(c.bucket_step));
  if (c.bucket_min_size < c.bucket_step || c.bucket_min_size > c.bucket_max_size ||
      c.resolution < c.bucket_min_size || c.resolution > c.bucket_max_size)
    fail("dataset.bucket_min_size = " + std::to_string(c.bucket_min_size) + ", dataset.resolution = " +
         std::to_string(c.resolution) + ", dataset.bucket_max_size = " + std::to_string(c.bucket_max_size) +
         ": need bucket_step <= bucket_min_size <= resolution <= bucket_max_size");
  if (!(c.bucket_max_aspect >= 1.0)) fail("dataset.bucket_max_aspect = " + std::to_string(c.bucket_max_aspect) + ": must be >= 1");
  if (!(c.max_upscale > 0.0)) fail("dataset.max_upscale = " + std::to_string(c.max_upscale) + ": must be > 0");
  if (c.crop != "center" && c.crop != "random") fail("dataset.crop = \"" + c.crop + "\": must be \"center\" or \"random\"");
  for (auto [name, p] : {std::pair{"dataset.flip_p", c.flip_p}, std::pair{"dataset.caption_dropout", c.caption_dropout}})
    if (!(p >= 0.0 && p <= 1.0)) fail(std::string(name) + " = " + std::to_string(p) + ": must be in [0, 1]");
  if (c.keep_tokens < 0) fail("dataset.keep_tokens = " + std::to_string(c.keep_tokens) + ": must be >= 0");
  if (c.caption_extension.empty()) fail("dataset.caption_extension is empty (e.g. \".txt\")");
}

namespace {

struct Candidate {
  fs::path image;
  std::string caption;
  bool caption_given = false;  // from a manifest (else the caption file is read)
  int64_t repeats = 1;
};

// Repeats of a file under `root`: the nearest "<N>_<name>" folder from the file up to root.
int64_t repeats_for(const fs::path& root, const fs::path& file, int64_t fallback) {
  const fs::path rel = file.parent_path().lexically_relative(root);
  std::vector<std::string> parts;
  for (const auto& p : rel)
    if (p != ".") parts.push_back(p.string());
  for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
    if (int64_t n = repeats_from_folder_name(*it); n > 0) return n;
  }
  if (int64_t n = repeats_from_folder_name(root.filename().string()); n > 0) return n;
  if (int64_t n = repeats_from_folder_name(root.parent_path().filename().string()); n > 0 && root.filename().empty())
    return n;  // "10_cat/" given with a trailing slash
  return fallback;
}

void collect_folder(const DatasetConfig& c, size_t i, std::vector<Candidate>& out) {
  const fs::path root = c.folders[i];
  std::error_code ec;
  if (!fs::is_directory(root, ec))
    throw std::runtime_error("dataset.folders: " + root.string() + " is not a folder" +
                             (fs::exists(root, ec) ? "" : " (it does not exist)"));
  const int64_t explicit_repeats = c.folder_repeats.empty() ? 0 : c.folder_repeats[i];
  std::vector<fs::path> files;
  auto consider = [&](const fs::directory_entry& e) {
    if (e.is_regular_file(ec) && is_image_name(e.path()) && e.path().filename().string()[0] != '.') files.push_back(e.path());
  };
  if (c.recursive) {
    for (auto it = fs::recursive_directory_iterator(root, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
      if (it->path().filename().string().starts_with(".")) {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      consider(*it);
    }
  } else {
    for (const auto& e : fs::directory_iterator(root)) consider(e);
  }
  std::sort(files.begin(), files.end());
  for (auto& f : files) {
    Candidate cand;
    cand.repeats = explicit_repeats > 0 ? explicit_repeats : repeats_for(root, f, c.repeats);
    cand.image = std::move(f);
    out.push_back(std::move(cand));
  }
}

void collect_manifest(const DatasetConfig& c, std::vector<Candidate>& out) {
  std::ifstream in(c.manifest);
  if (!in) throw std::runtime_error("dataset.manifest: cannot open " + c.manifest);
  const fs::path base = fs::path(c.manifest).parent_path();
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (trim(line).empty()) continue;
    const std::string where = c.manifest + ":" + std::to_string(line_no);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const std::exception& e) {
      throw std::runtime_error(where + ": not a JSON object (" + e.what() + ")");
    }
    if (!j.is_object() || !j.contains("file") || !j["file"].is_string())
      throw std::runtime_error(where + ": each line must be an object with a \"file\" string, e.g. "
                               "{\"file\": \"img/1.png\", \"caption\": \"a cat\"}");
    Candidate cand;
    const fs::path file = j["file"].get<std::string>();
    cand.image = file.is_absolute() ? file : base / file;
    if (j.contains("caption")) {
      if (!j["caption"].is_string()) throw std::runtime_error(where + ": \"caption\" must be a string");
      cand.caption = trim(j["caption"].get<std::string>());
    }
    cand.caption_given = j.contains("caption");
    cand.repeats = c.repeats;
    if (j.contains("repeats")) {
      if (!j["repeats"].is_number_integer() || j["repeats"].get<int64_t>() < 1)
        throw std::runtime_error(where + ": \"repeats\" must be an integer >= 1, got " + j["repeats"].dump());
      cand.repeats = j["repeats"].get<int64_t>();
    }
    out.push_back(std::move(cand));
  }
}

}  // namespace

int64_t repeats_from_folder_name(const std::string& name) {
  const size_t us = name.find('_');
  if (us == std::string::npos || us == 0 || us > 9) return 0;
  int64_t n = 0;
  for (size_t i = 0; i < us; ++i) {
    if (name[i] < '0' || name[i] > '9') return 0;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

std::vector<Bucket> make_buckets(const DatasetConfig& c) {
  const int64_t area = c.resolution * c.resolution, step = c.bucket_step;
  std::vector<Bucket> out;
  for (int64_t w = c.bucket_min_size; w <= c.bucket_max_size; w += step) {
    const int64_t h = std::min(area / w / step * step, c.bucket_max_size);
    if (h < c.bucket_min_size) continue;
    if (static_cast<double>(std::max(w, h)) / static_cast<double>(std::min(w, h)) > c.bucket_max_aspect + 1e-9) continue;
    out.push_back({static_cast<int>(w), static_cast<int>(h)});
  }
  return out;
}

int nearest_bucket(const std::vector<Bucket>& buckets, int width, int height) {
  const double target = std::log(static_cast<double>(width) / height);
  int best = -1;
  double best_d = 0.0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const double d = std::abs(std::log(static_cast<double>(buckets[i].width) / buckets[i].height) - target);
    const bool larger = best >= 0 && static_cast<int64_t>(buckets[i].width) * buckets[i].height >
                                         static_cast<int64_t>(buckets[best].width) * buckets[best].height;
    if (best < 0 || d < best_d - 1e-12 || (std::abs(d - best_d) <= 1e-12 && larger)) {
      best = static_cast<int>(i);
      best_d = d;
    }
  }
  return best;
}

std::string transform_caption(const std::string& caption, const DatasetConfig& c, uint64_t rng_seed) {
  flame::HostRng rng(rng_seed);
  if (c.caption_dropout > 0.0 && uniform01(rng) < c.caption_dropout) return "";
  std::string text = caption;
  if (c.shuffle_tags) {
    std::vector<std::string> tags;
    std::stringstream ss(caption);
    for (std::string tag; std::getline(ss, tag, ',');) {
      if (std::string t = trim(tag); !t.empty()) tags.push_back(std::move(t));
    }
    const size_t keep = std::min(tags.size(), static_cast<size_t>(c.keep_tokens));
    std::vector<std::string> rest(tags.begin() + static_cast<std::ptrdiff_t>(keep), tags.end());
    shuffle_in_place(rest, rng);
    std::copy(rest.begin(), rest.end(), tags.begin() + static_cast<std::ptrdiff_t>(keep));
    text.clear();
    for (size_t i = 0; i < tags.size(); ++i) text += (i ? ", " : "") + tags[i];
  }
  return c.caption_prefix + text + c.caption_suffix;
}

ImageDataset ImageDataset::scan(const DatasetConfig& config, const Log& log) {
  check_dataset_config(config, true);
  ImageDataset ds;
  ds.config_ = config;
  ds.log_ = log ? log : Log([](const std::string& line) { std::cerr << "dataset: " << line << "\n"; });
  auto warn = [&](const std::string& msg) {
    ds.warnings_.push_back(msg);
    ds.log_("warning: " + msg);
  };

  std::vector<Candidate> candidates;
  for (size_t i = 0; i < config.folders.size(); ++i) collect_folder(config, i, candidates);
  if (!config.manifest.empty()) collect_manifest(config, candidates);

  ds.buckets_ = config.bucketing ? make_buckets(config)
                                 : std::vector<Bucket>{{static_cast<int>(config.resolution), static_cast<int>(config.resolution)}};
  if (ds.buckets_.empty())
    throw std::runtime_error("dataset: no bucket fits dataset.bucket_min_size = " + std::to_string(config.bucket_min_size) +
                             ", bucket_max_size = " + std::to_string(config.bucket_max_size) + " and bucket_max_aspect = " +
                             std::to_string(config.bucket_max_aspect) + " at resolution " + std::to_string(config.resolution));
  std::string ext = config.caption_extension;
  if (ext[0] != '.') ext = "." + ext;
  int64_t skipped = 0;
  const int64_t step = config.bucket_step;
  for (Candidate& cand : candidates) {
    const std::string path = cand.image.string();
    ImageRecord rec;
    rec.path = path;
    rec.repeats = cand.repeats;
    try {
      if (config.verify_images) {
        const Image rgb = decode_image(path);
        rec.width = rgb.width;
        rec.height = rgb.height;
      } else {
        const ImageInfo info = read_image_info(path);
        rec.width = info.width;
        rec.height = info.height;
      }
    } catch (const std::exception& e) {
      warn(std::string("skipped ") + e.what());
      ++skipped;
      continue;
    }
    int b = nearest_bucket(ds.buckets_, rec.width, rec.height);
    const Bucket& nb = ds.buckets_[b];
    const double need = std::max(static_cast<double>(nb.width) / rec.width, static_cast<double>(nb.height) / rec.height);
    if (need > config.max_upscale * (1.0 + 1e-9)) {
      int64_t fw = static_cast<int64_t>(std::floor(rec.width * config.max_upscale / step)) * step;
      int64_t fh = static_cast<int64_t>(std::floor(rec.height * config.max_upscale / step)) * step;
      fw = std::min(fw, config.bucket_max_size);
      fh = std::min(fh, config.bucket_max_size);
      const double amax = config.bucket_max_aspect;
      if (fw > fh * amax) fw = static_cast<int64_t>(std::floor(fh * amax / step)) * step;
      if (fh > fw * amax) fh = static_cast<int64_t>(std::floor(fw * amax / step)) * step;
      if (!config.bucketing || fw < config.bucket_min_size || fh < config.bucket_min_size) {
        warn("skipped " + path + ": " + size_text(rec.width, rec.height) + " would need " + std::to_string(need) +
             "x upscaling for the " + size_text(nb.width, nb.height) + " bucket, more than dataset.max_upscale = " +
             std::to_string(config.max_upscale) +
             (config.bucketing ? ", and a smaller bucket would be under dataset.bucket_min_size = " +
                                     std::to_string(config.bucket_min_size)
                               : " (bucketing is off; lower dataset.resolution or raise dataset.max_upscale)"));
        ++skipped;
        continue;
      }
      const Bucket small{static_cast<int>(fw), static_cast<int>(fh)};
      auto it = std::find(ds.buckets_.begin(), ds.buckets_.end(), small);
      b = static_cast<int>(it - ds.buckets_.begin());
      if (it == ds.buckets_.end()) ds.buckets_.push_back(small);
    }
    rec.bucket = b;
    if (cand.caption_given) {
      rec.caption = cand.caption;
    } else {
      fs::path cap = cand.image;
      cap.replace_extension(ext);
      std::error_code ec;
      if (fs::is_regular_file(cap, ec)) {
        rec.caption = read_caption(cap);
      } else {
        warn("no caption for " + path + " (" + cap.string() + " is missing): its caption is empty");
      }
    }
    ds.records_.push_back(std::move(rec));
  }
  if (ds.records_.empty()) {
    std::string sources;
    for (const auto& f : config.folders) sources += (sources.empty() ? "" : ", ") + f;
    if (!config.manifest.empty()) sources += (sources.empty() ? "manifest " : ", manifest ") + config.manifest;
    throw std::runtime_error("dataset: no usable image in " + sources + " (" + std::to_string(candidates.size()) +
                             " image files found, " + std::to_string(skipped) +
                             " skipped: see the warnings above; images are *.jpg, *.jpeg, *.png, *.webp)");
  }
  int64_t total = 0;
  for (int64_t n : ds.bucket_counts()) total += n;
  ds.log_(std::to_string(ds.records_.size()) + " images (" + std::to_string(total) + " per epoch with repeats), " +
          std::to_string(skipped) + " skipped; buckets:\n" + ds.bucket_histogram());
  return ds;
}

std::vector<int64_t> ImageDataset::bucket_counts() const {
  std::vector<int64_t> counts(buckets_.size(), 0);
  for (const auto& r : records_) counts[r.bucket] += r.repeats;
  return counts;
}

std::string ImageDataset::bucket_histogram() const {
  std::vector<int64_t> images(buckets_.size(), 0);
  for (const auto& r : records_) ++images[r.bucket];
  const std::vector<int64_t> counts = bucket_counts();
  std::vector<size_t> order;
  for (size_t i = 0; i < buckets_.size(); ++i)
    if (images[i] > 0) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(buckets_[a].width, buckets_[a].height) < std::pair(buckets_[b].width, buckets_[b].height);
  });
  std::ostringstream os;
  for (size_t i : order) {
    char line[160];
    std::snprintf(line, sizeof line, "  %5dx%-5d aspect %.2f  %lld images (%lld with repeats)\n", buckets_[i].width,
                  buckets_[i].height, static_cast<double>(buckets_[i].width) / buckets_[i].height,
                  static_cast<long long>(images[i]), static_cast<long long>(counts[i]));
    os << line;
  }
  return os.str();
}

ImageItem ImageDataset::describe(int64_t index, uint64_t seed) const {
  if (index < 0 || index >= static_cast<int64_t>(records_.size()))
    throw std::out_of_range("ImageDataset::describe: index " + std::to_string(index) + " is outside [0, " +
                            std::to_string(records_.size()) + ")");
  const ImageRecord& rec = records_[index];
  const Bucket bucket = buckets_[rec.bucket];
  const int W = rec.width, H = rec.height, bw = bucket.width, bh = bucket.height;
  // The smallest size of the image's aspect ratio covering the bucket: one side is the bucket's.
  const double sx = static_cast<double>(bw) / W, sy = static_cast<double>(bh) / H;
  CropBox box;
  if (sx >= sy) {
    box.resized_width = bw;
    box.resized_height = std::max(bh, static_cast<int>(std::lround(H * sx)));
  } else {
    box.resized_height = bh;
    box.resized_width = std::max(bw, static_cast<int>(std::lround(W * sy)));
  }
  box.width = bw;
  box.height = bh;
  if (config_.crop == "random") {
    flame::HostRng rng(flame::HostRng::mix(seed, 2));
    box.x = static_cast<int>(rng.below(static_cast<uint64_t>(box.resized_width - bw + 1)));
    box.y = static_cast<int>(rng.below(static_cast<uint64_t>(box.resized_height - bh + 1)));
  } else {
    box.x = (box.resized_width - bw) / 2;
    box.y = (box.resized_height - bh) / 2;
  }
  flame::HostRng flip_rng(flame::HostRng::mix(seed, 1));
  ImageItem item;
  item.caption = transform_caption(rec.caption, config_, flame::HostRng::mix(seed, 3));
  item.path = rec.path;
  item.record = index;
  item.bucket = bucket;
  item.crop = box;
  item.flipped = config_.flip_p > 0.0 && uniform01(flip_rng) < config_.flip_p;
  item.original_width = W;
  item.original_height = H;
  return item;
}

ImageItem ImageDataset::make_item(int64_t index, const Image& rgb, uint64_t seed, std::optional<bool> flip) const {
  ImageItem item = describe(index, seed);
  if (flip) item.flipped = *flip;
  const CropBox& box = item.crop;
  const int bw = box.width, bh = box.height;
  const std::vector<float> hwc = resize_lanczos_window(rgb.pixels.data(), rgb.width, rgb.height, 3, box.resized_width,
                                                       box.resized_height, box.x, box.y, bw, bh, item.flipped);
  std::vector<float> chw(hwc.size());
  const size_t plane = static_cast<size_t>(bw) * bh;
  for (size_t p = 0; p < plane; ++p) {
    for (int c = 0; c < 3; ++c) chw[c * plane + p] = std::clamp(hwc[p * 3 + c], 0.0f, 255.0f) / 127.5f - 1.0f;
  }
  item.image = flame::Tensor::from_vec(chw, {3, bh, bw});
  return item;
}

ImageItem ImageDataset::item(int64_t index, uint64_t seed, std::optional<bool> flip) const {
  if (index < 0 || index >= static_cast<int64_t>(records_.size()))
    throw std::out_of_range("ImageDataset::item: index " + std::to_string(index) + " is outside [0, " +
                            std::to_string(records_.size()) + ")");
  const int bucket = records_[index].bucket;
  const int64_t n = static_cast<int64_t>(records_.size());
  std::string first_error;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t j = (index + k) % n;
    if (records_[j].bucket != bucket) continue;
    try {
      Image rgb = decode_image(records_[j].path);
      if (rgb.width != records_[j].width || rgb.height != records_[j].height)
        throw ImageDecodeError(records_[j].path + ": now " + size_text(rgb.width, rgb.height) + ", was " +
                               size_text(records_[j].width, records_[j].height) + " when the data set was scanned");
      return make_item(j, rgb, seed, flip);
    } catch (const ImageDecodeError& e) {
      if (first_error.empty()) first_error = e.what();
      log_(std::string("warning: ") + e.what() + "; using the next image of its bucket instead");
    }
  }
  throw std::runtime_error("dataset: no image of bucket " + size_text(buckets_[bucket].width, buckets_[bucket].height) +
                           " decodes any more (first: " + first_error + ")");
}

// ---- batches ----

BucketBatchSampler::BucketBatchSampler(const ImageDataset& dataset, int64_t batch_size, uint64_t seed, bool shuffle,
                                       int num_replicas, int rank)
    : per_bucket_(dataset.buckets().size()),
      batch_size_(batch_size),
      seed_(seed),
      shuffle_(shuffle),
      num_replicas_(num_replicas),
      rank_(rank) {
  if (batch_size < 1) throw std::runtime_error("BucketBatchSampler: batch size " + std::to_string(batch_size) + " must be >= 1");
  if (num_replicas < 1 || rank < 0 || rank >= num_replicas)
    throw std::runtime_error("BucketBatchSampler: rank " + std::to_string(rank) + " of " + std::to_string(num_replicas) +
                             " replicas is out of range");
  const auto& recs = dataset.records();
  for (size_t i = 0; i < recs.size(); ++i) {
    for (int64_t r = 0; r < recs[i].repeats; ++r) per_bucket_[recs[i].bucket].push_back(static_cast<int64_t>(i));
  }
  int64_t batches = 0;
  for (const auto& list : per_bucket_) {
    const int64_t n = static_cast<int64_t>(list.size());
    batches += (n + batch_size - 1) / batch_size;
  }
  num_samples_ = (batches + num_replicas - 1) / num_replicas * batch_size;
}

std::vector<int64_t> BucketBatchSampler::indices(int64_t epoch) const {
  const uint64_t epoch_seed = flame::HostRng::mix(seed_, static_cast<uint64_t>(epoch));
  std::vector<std::vector<int64_t>> batches;
  for (size_t b = 0; b < per_bucket_.size(); ++b) {
    std::vector<int64_t> list = per_bucket_[b];
    const size_t n = list.size();
    if (n == 0) continue;
    if (shuffle_) {
      flame::HostRng rng(flame::HostRng::mix(epoch_seed, b));
      shuffle_in_place(list, rng);
    }
    const size_t padded = (n + batch_size_ - 1) / batch_size_ * batch_size_;
    for (size_t k = n; k < padded; ++k) list.push_back(list[k % n]);
    for (size_t s = 0; s < padded; s += batch_size_) batches.emplace_back(list.begin() + s, list.begin() + s + batch_size_);
  }
  if (shuffle_) {
    flame::HostRng rng(epoch_seed);
    shuffle_in_place(batches, rng);
  }
  std::vector<int64_t> out;
  out.reserve(num_samples_);
  if (batches.empty()) return out;
  // This rank's share: batches rank, rank + W, ... of the list padded with its head to a multiple of W.
  const size_t per_rank = (batches.size() + num_replicas_ - 1) / num_replicas_;
  for (size_t k = 0; k < per_rank; ++k) {
    const auto& batch = batches[(k * num_replicas_ + rank_) % batches.size()];
    out.insert(out.end(), batch.begin(), batch.end());
  }
  return out;
}

void for_each_tensor(ImageBatch& batch, const std::function<void(flame::Tensor&)>& fn) {
  if (batch.images.defined()) fn(batch.images);  // undefined when the loader does not decode
}

namespace {
// The records as flame::data examples: example i is its index; the loader's transform makes the items.
class RecordIndices : public flame::data::Dataset<int64_t> {
 public:
  explicit RecordIndices(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  int64_t get(int64_t index) const override { return index; }

 private:
  int64_t n_;
};
}  // namespace

ImageLoader::ImageLoader(std::shared_ptr<const ImageDataset> dataset, const ImageLoaderOptions& o,
                         flame::data::LoaderState start)
    : dataset_(std::move(dataset)) {
  flame::data::DataLoaderOptions opts;
  opts.batch_size = o.batch_size;
  opts.seed = o.seed;
  opts.drop_last = false;  // the sampler's lists are whole batches
  // Several ranks: each draws its own augmentation (flips, crops, caption dropout) for its batches.
  if (o.num_replicas > 1) opts.seed = flame::HostRng::mix(o.seed, 0x72616e6b0000ull + static_cast<uint64_t>(o.rank));
  opts.sampler = std::make_shared<BucketBatchSampler>(*dataset_, o.batch_size, o.seed, o.shuffle, o.num_replicas, o.rank);
  opts.num_workers = o.num_workers;
  opts.prefetch_factor = o.prefetch_factor;
  opts.device = o.device;
  auto collate = [](std::vector<int64_t> indices) {
    ImageBatch batch;
    batch.items.resize(indices.size());
    for (size_t j = 0; j < indices.size(); ++j) batch.items[j].record = indices[j];
    return batch;
  };
  auto transform = [ds = dataset_, decode = o.decode](ImageBatch& batch, const flame::data::BatchInfo& info) {
    std::vector<flame::Tensor> images;
    for (size_t j = 0; j < batch.items.size(); ++j) {
      const uint64_t seed = flame::HostRng::mix(info.seed, j);
      if (!decode) {
        batch.items[j] = ds->describe(batch.items[j].record, seed);
        continue;
      }
      ImageItem item = ds->item(batch.items[j].record, seed);
      images.push_back(std::move(item.image));
      item.image = flame::Tensor();
      batch.items[j] = std::move(item);
    }
    if (decode) batch.images = flame::data::collate_tensors(images, false, "image");
    batch.position = {info.epoch, info.batch, 0};
  };
  auto indices = std::make_shared<RecordIndices>(static_cast<int64_t>(dataset_->records().size()));
  loader_ = std::make_unique<flame::data::DataLoader<int64_t, ImageBatch>>(indices, opts, collate, transform);
  if (start.epoch != 0 || start.batch != 0) loader_->load_state({start.epoch, start.batch, opts.seed});
}

ImageBatch ImageLoader::next() {
  ImageBatch b = loader_->next();
  b.position.seed = loader_->state().seed;
  return b;
}

}  // namespace flame_diffusion
