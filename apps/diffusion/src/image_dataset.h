#pragma once
// Image/caption data sets for fine-tuning: folders of images with same-name caption files (kohya's
// and ai-toolkit's layout) or a JSONL manifest, aspect-ratio buckets, the per-item transforms and
// a bucketed batch loader over flame::data's DataLoader.
//
//   DatasetConfig cfg = default_dataset_config();  cfg.folders = {"train/"};  cfg.resolution = 1024;  cfg.flip_p = 0.5;
//   auto ds = std::make_shared<const ImageDataset>(ImageDataset::scan(cfg));   // logs the buckets
//   ImageLoader loader(ds, {.batch_size = 4, .seed = 1, .num_workers = 2});
//   ImageBatch b = loader.next();   // b.images f32 [4, 3, H, W] in [-1, 1], one bucket's H x W
//
// Note [Image data set layout]
// Each folder is walked (recursively unless `recursive` is off) in sorted path order; files named
// *.jpg, *.jpeg, *.png, *.webp (any case) are images, hidden files and folders are skipped. An
// image's caption is the file beside it with the same stem and `caption_extension` (default .txt),
// read whole, trimmed, line breaks turned into spaces; a missing one is an empty caption and a
// warning. Repeats: a folder named "<N>_<name>" (kohya) repeats the images under it N times per
// epoch (the nearest such folder counts); `folder_repeats[i]` given for folders[i] overrides that
// for everything under it; otherwise `repeats`. A manifest is one JSON object a line,
// {"file": path, "caption": text, "repeats": n}, paths relative to the manifest's folder; without
// "caption" the caption file beside the image is read as for a folder; "repeats" is optional. Every image is decoded once while scanning (unless
// verify_images is off, then only its headers are read): a file that does not decode is reported,
// naming it and the reason, and skipped; the scan fails only when no image is left.
//
// Note [Aspect-ratio buckets]
// The buckets are the sizes w x h, multiples of `bucket_step` in [bucket_min_size, bucket_max_size],
// with h = floor(resolution² / w / step) * step (the largest height keeping the area at most the
// target) and an aspect ratio of at most `bucket_max_aspect` either way. Each image goes to the
// bucket nearest its aspect ratio (by |log(w/h) - log(W/H)|; ties to the larger area). An image
// that would need more than `max_upscale` to cover its bucket instead gets the bucket of its own
// size times max_upscale, each side rounded down to the step (a smaller bucket, added to the list);
// if that is under bucket_min_size it is reported and skipped. With bucketing off, every image has
// the square resolution² bucket and one needing more than max_upscale is reported and skipped.
//
// Note [Image item transforms]
// An item is made from (image, seed) alone: the image is resized, keeping its aspect ratio, to the
// smallest size covering its bucket (Lanczos-3 with antialiasing, Note [Lanczos resize] in
// image_decode.h), the bucket's window is cropped out (centred, or at a random offset), flipped
// horizontally with probability flip_p, and mapped to f32 [-1, 1] CHW as x / 127.5 - 1. The
// caption is dropped (made empty) with probability caption_dropout; otherwise, with shuffle_tags,
// its comma-separated tags after the first keep_tokens are shuffled (joined with ", "), then
// caption_prefix and caption_suffix are added as they are. The flip, the crop offset and the caption
// each draw from their own stream, HostRng(mix(seed, 1 / 2 / 3)), so turning one on does not move
// another. The loader's item seed is mix(BatchInfo::seed, slot in the batch): reproducible from
// (loader seed, epoch, batch) as flame::data's Note [Loader determinism].
//
// Note [Bucketed batches]
// Every batch comes from one bucket. Epoch e's index list (BucketBatchSampler) is built per bucket:
// its images, each `repeats` times, shuffled with HostRng(mix(mix(seed, e), bucket)), padded to a
// multiple of the batch size by repeating the bucket's list from its start (so no image is left
// out and a bucket smaller than a batch repeats images within it), cut into batches; the batches
// of all buckets are then shuffled with HostRng(mix(seed, e)). The list has the same length every
// epoch, so the DataLoader's batch i of epoch e is the run [i * B, (i + 1) * B) of one bucket.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <flame/data.h>
#include <flame/flame.h>

#include "png_image.h"

namespace flame_diffusion {

// What a data set is built from and how its items are made. The defaults, and what each field
// does, are the fine-tuning configuration's [dataset] table (train_config.h): start from
// default_dataset_config() (the zeros here are placeholders).
struct DatasetConfig {
  std::vector<std::string> folders;
  std::vector<int64_t> folder_repeats;  // empty, or one per folder (0: the folder's name or `repeats`)
  std::string manifest;                 // a JSONL file; may be combined with folders
  std::string caption_extension;
  int64_t repeats = 0;
  bool recursive = false;
  bool verify_images = false;
  int64_t resolution = 0;
  bool bucketing = false;
  int64_t bucket_step = 0;
  int64_t bucket_min_size = 0;
  int64_t bucket_max_size = 0;
  double bucket_max_aspect = 0.0;
  double max_upscale = 0.0;
  std::string crop;  // "center" or "random"
  double flip_p = 0.0;
  double caption_dropout = 0.0;
  bool shuffle_tags = false;
  int64_t keep_tokens = 0;
  std::string caption_prefix;
  std::string caption_suffix;
};
// The [dataset] table's defaults (defined with the table, in train_config.cpp).
DatasetConfig default_dataset_config();
// The checks between fields (bucket limits around the resolution, one folder_repeats entry per
// folder, ...) and, with require_sources, that a folder or a manifest is given. Raises
// std::runtime_error naming the keys (dataset.<field>) and values.
void check_dataset_config(const DatasetConfig& config, bool require_sources);

struct Bucket {
  int width = 0, height = 0;
  bool operator==(const Bucket&) const = default;
};

// One image of the data set as scanned.
struct ImageRecord {
  std::string path;
  std::string caption;  // as read (before the caption transforms)
  int width = 0, height = 0;
  int64_t repeats = 1;
  int bucket = 0;  // index into ImageDataset::buckets()
};

// The window of the resized image an item holds: the image was resized to resized_width x
// resized_height and [x, x + width) x [y, y + height) was kept (before the flip).
struct CropBox {
  int x = 0, y = 0, width = 0, height = 0;
  int resized_width = 0, resized_height = 0;
  bool operator==(const CropBox&) const = default;
};

// One training example.
struct ImageItem {
  flame::Tensor image;  // f32 [3, bucket height, bucket width] in [-1, 1] (cleared inside a batch)
  std::string caption;  // after dropout, tag shuffling, prefix and suffix
  std::string path;
  int64_t record = 0;  // index into ImageDataset::records()
  Bucket bucket;
  CropBox crop;
  bool flipped = false;
  int original_width = 0, original_height = 0;  // the decoded image's size (SDXL's size conditioning)
};

class ImageDataset {
 public:
  using Log = std::function<void(const std::string&)>;

  // Scans the folders and manifest (Note [Image data set layout]) and assigns buckets (Note
  // [Aspect-ratio buckets]). Each skipped file and missing caption is a warning, passed to `log`
  // (default: standard error, "dataset: warning: ...") and kept in warnings(); the bucket
  // histogram is logged at the end. Raises std::runtime_error on a bad setting, a folder or
  // manifest that cannot be read, a malformed manifest line (naming file and line), or when no
  // image is left (naming the folders and manifest and how many files were skipped). `log` is kept
  // for item()'s warnings, which the loader's worker threads raise: it must be safe to call from them.
  static ImageDataset scan(const DatasetConfig& config, const Log& log = {});

  const DatasetConfig& config() const { return config_; }
  const std::vector<ImageRecord>& records() const { return records_; }
  const std::vector<Bucket>& buckets() const { return buckets_; }
  const std::vector<std::string>& warnings() const { return warnings_; }
  // Items per bucket, with repeats: what one epoch draws.
  std::vector<int64_t> bucket_counts() const;
  // One line per non-empty bucket: "  1024x1024  aspect 1.00  12 images (36 with repeats)".
  std::string bucket_histogram() const;

  // The item of record `index` made with `seed` (Note [Image item transforms]). When the file no
  // longer decodes (changed since the scan), the next record of the same bucket that does is used
  // instead, with a warning to the log; raises only when none of the bucket's records decodes.
  // With `flip` given, the item is flipped or not as it says instead of by the seed (the latent
  // cache encodes both orientations).
  ImageItem item(int64_t index, uint64_t seed, std::optional<bool> flip = std::nullopt) const;
  // The same item without its pixels (image undefined): caption, crop, flip and sizes from the
  // scanned record alone, nothing decoded. item(index, seed) is describe(index, seed) plus pixels
  // (unless the file no longer decodes and another record stands in).
  ImageItem describe(int64_t index, uint64_t seed) const;

 private:
  ImageItem make_item(int64_t index, const Image& rgb, uint64_t seed, std::optional<bool> flip) const;

  DatasetConfig config_;
  std::vector<ImageRecord> records_;
  std::vector<Bucket> buckets_;
  std::vector<std::string> warnings_;
  Log log_;
};

// ---- pieces of the above, exposed for tests and tools ----

// The standard buckets of a configuration (Note [Aspect-ratio buckets]), sorted by width.
std::vector<Bucket> make_buckets(const DatasetConfig& config);
// The index in `buckets` nearest the aspect ratio of a width x height image.
int nearest_bucket(const std::vector<Bucket>& buckets, int width, int height);
// The caption transforms of Note [Image item transforms], drawing from `rng_seed`.
std::string transform_caption(const std::string& caption, const DatasetConfig& config, uint64_t rng_seed);
// "<N>_<name>" -> N (> 0); 0 when the name does not have that form.
int64_t repeats_from_folder_name(const std::string& name);

// Note [Bucketed batches]: batch-aligned epoch lists of record indices.
// With num_replicas > 1 (several ranks) every rank builds the same epoch list of batches, padded by
// repeating its first batches to a multiple of num_replicas, and takes batches rank, rank +
// num_replicas, ...: each rank's share of every epoch, the same number of batches on each.
class BucketBatchSampler : public flame::data::Sampler {
 public:
  BucketBatchSampler(const ImageDataset& dataset, int64_t batch_size, uint64_t seed, bool shuffle = true,
                     int num_replicas = 1, int rank = 0);
  int64_t num_samples() const override { return num_samples_; }
  std::vector<int64_t> indices(int64_t epoch) const override;

 private:
  std::vector<std::vector<int64_t>> per_bucket_;  // record indices with repeats, in record order
  int64_t batch_size_;
  uint64_t seed_;
  bool shuffle_;
  int num_replicas_ = 1, rank_ = 0;
  int64_t num_samples_ = 0;  // this rank's
};

struct ImageBatch {
  flame::Tensor images;             // f32 [B, 3, H, W], on the loader's device
  std::vector<ImageItem> items;     // per sample: caption, path, bucket, crop, flip (image cleared)
  flame::data::LoaderState position;  // which batch this is
};
// The batch's tensors for flame::data's pinning and upload (Note [Batch tensors]).
void for_each_tensor(ImageBatch& batch, const std::function<void(flame::Tensor&)>& fn);

struct ImageLoaderOptions {
  int64_t batch_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  int num_workers = 2;  // threads decoding and resizing batches ahead (Note [Loader workers])
  int prefetch_factor = 2;
  flame::Device device = flame::Device::cpu();
  // Several ranks: this rank's share of every epoch (BucketBatchSampler), with its own augmentation draws.
  int num_replicas = 1;
  int rank = 0;
  // false: the items are described (ImageDataset::describe), not decoded, and `images` is
  // undefined: a trainer whose latents are cached needs only the captions, flips and crops.
  bool decode = true;
};

// flame::data::DataLoader over an ImageDataset with a BucketBatchSampler: batches of one bucket,
// items made on the worker threads; its position is a LoaderState to checkpoint.
class ImageLoader {
 public:
  ImageLoader(std::shared_ptr<const ImageDataset> dataset, const ImageLoaderOptions& options,
              flame::data::LoaderState start = {});
  ImageBatch next();
  flame::data::LoaderState position() const { return loader_->state(); }
  int64_t batches_per_epoch() const { return loader_->batches_per_epoch(); }
  // The record indices of batch `batch` of epoch `epoch`, and its seed.
  flame::data::BatchInfo batch_info(int64_t epoch, int64_t batch) const { return loader_->batch_info(epoch, batch); }

 private:
  std::shared_ptr<const ImageDataset> dataset_;
  std::unique_ptr<flame::data::DataLoader<int64_t, ImageBatch>> loader_;
};

}  // namespace flame_diffusion
