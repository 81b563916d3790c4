#include "trainer.h"

#include <flame/amp.h>
#include <flame/checkpoint.h>
#include <flame/cuda/graph_step.h>
#include <flame/flame.h>
#include <flame/nn.h>
#include <flame/optim/ema.h>
#include <flame/optim/optimizers.h>
#include <flame/optim/scheduler.h>
#include <flame/io/safetensors.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "classifier.h"
#include "cli_checks.h"
#include "data.h"
#include "distributed.h"
#include "dit.h"
#include "embed.h"
#include "objective.h"
#include "plot.h"
#include "png_image.h"
#include "run_dir.h"
#include "stop_signal.h"

namespace flame_diffusion {

using flame::Device;
using flame::DType;
using flame::Tensor;
namespace fs = std::filesystem;
namespace optim = flame::optim;

// ---- small parsers ----

Device parse_device(const std::string& name) {
  if (name == "auto") return flame::cuda_is_available() ? Device::cuda(0) : Device::cpu();
  if (name == "cpu") return Device::cpu();
  if (name == "cuda" || name.rfind("cuda:", 0) == 0) {
    if (!flame::cuda_is_available())
      throw std::runtime_error("--device " + name + ": no CUDA device is available (use --device cpu or auto)");
    int index = 0;
    if (name.size() > 5) {
      try {
        std::size_t used = 0;
        index = std::stoi(name.substr(5), &used);
        if (used != name.size() - 5 || index < 0) throw std::invalid_argument("index");
      } catch (const std::exception&) {
        throw std::runtime_error("--device " + name + ": expected cuda:N with N a GPU index");
      }
    }
    return Device::cuda(index);
  }
  throw std::runtime_error("--device " + name + ": expected auto, cpu, cuda or cuda:N");
}

std::vector<int> parse_classes(const std::string& text, int num_classes) {
  std::vector<int> out;
  std::stringstream ss(text);
  std::string part;
  auto bad = [&](const std::string& why) {
    return std::runtime_error("classes '" + text + "': " + why + " (expected e.g. 0-9, 3 or 1,4,7; ids 0.." +
                              std::to_string(num_classes - 1) + ")");
  };
  auto number = [&](const std::string& s) {
    if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos) throw bad("'" + s + "' is not a class id");
    const long v = std::stol(s);
    if (v < 0 || v >= num_classes) throw bad(s + " is out of range");
    return static_cast<int>(v);
  };
  while (std::getline(ss, part, ',')) {
    const auto dash = part.find('-');
    if (dash == std::string::npos) {
      out.push_back(number(part));
    } else {
      const int a = number(part.substr(0, dash)), b = number(part.substr(dash + 1));
      if (a > b) throw bad("range " + part + " is empty");
      for (int c = a; c <= b; ++c) out.push_back(c);
    }
  }
  if (out.empty()) throw bad("no class given");
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The autocast dtype of a run: auto means bf16 on CUDA and none on the CPU (bf16 matmuls on the
// CPU reference backend are slower than f32).
std::optional<DType> autocast_dtype(const std::string& amp, const Device& dev) {
  if (amp == "off") return std::nullopt;
  if (amp == "bf16") return DType::bf16;
  if (amp == "f16") return DType::f16;
  if (amp == "auto") return dev.is_cuda() ? std::optional<DType>(DType::bf16) : std::nullopt;
  throw std::runtime_error("--amp " + amp + ": expected auto, bf16, f16 or off");
}

// An autocast scope that may be empty.
class MaybeAutocast {
 public:
  MaybeAutocast(std::optional<DType> dtype, const Device& dev) {
    if (dtype) guard_.emplace(*dtype, dev.is_cuda() ? flame::DeviceType::cuda : flame::DeviceType::cpu);
  }

 private:
  std::optional<flame::amp::AutocastGuard> guard_;
};

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1 << 30) std::snprintf(buf, sizeof buf, "%.2f GiB", b / (1 << 30));
  else std::snprintf(buf, sizeof buf, "%.0f MiB", b / (1 << 20));
  return buf;
}

std::string human_time(double s) {
  char buf[32];
  const long t = static_cast<long>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%ldh%02ldm", t / 3600, t / 60 % 60);
  else std::snprintf(buf, sizeof buf, "%ldm%02lds", t / 60, t % 60);
  return buf;
}

int64_t gpu_bytes(const Device& dev, bool peak) {
  if (!dev.is_cuda()) return 0;
  const auto st = flame::cuda::memory_stats(dev.index);
  return static_cast<int64_t>(peak ? st.peak_allocated_bytes : st.allocated_bytes);
}

// One status line: a bar, step, loss, it/s, img/s, ETA and GPU memory. On a terminal it redraws
// in place; otherwise (logs, CI) it prints a line every log_every steps.
class ProgressBar {
 public:
  // live: redraw in place on a terminal; log lines are printed either way.
  ProgressBar(int64_t total, bool live) : total_(total), tty_(live && isatty(fileno(stderr)) != 0) {}
  void update(int64_t step, double loss, double it_s, double img_s, double eta_s, int64_t gpu, bool log_line) {
    if (!tty_ && !log_line) return;
    if (tty_ && !log_line && seconds_since(last_) < 0.25 && step != total_) return;
    last_ = Clock::now();
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * static_cast<double>(step) / std::max<int64_t>(total_, 1));
    std::string bar(static_cast<std::size_t>(filled), '#');
    bar.resize(kWidth, '.');
    char line[256];
    std::snprintf(line, sizeof line, "[%s] %lld/%lld loss %.4f | %.2f it/s %.0f img/s | ETA %s%s%s", bar.c_str(),
                  static_cast<long long>(step), static_cast<long long>(total_), loss, it_s, img_s,
                  human_time(eta_s).c_str(), gpu > 0 ? " | GPU " : "", gpu > 0 ? human_bytes(double(gpu)).c_str() : "");
    if (tty_) std::fprintf(stderr, "\r%-110s%s", line, log_line ? "\n" : "");
    else std::fprintf(stderr, "%s\n", line);
    std::fflush(stderr);
  }

 private:
  int64_t total_;
  bool tty_;
  Clock::time_point last_ = Clock::now();
};

// Progress of a sampling that may take minutes (the end-of-run grid and classifier samples on the
// CPU, `sample`): a line on stderr when it starts, then one every `every_s` seconds with the solver
// steps done of all, the time spent and an ETA. `stop`: a SIGINT / SIGTERM ends it between model
// calls (Interrupted, saying `on_stop`); a sampling inside the training loop leaves stops to the loop.
class SamplingProgress {
 public:
  SamplingProgress(std::string what, int64_t total_steps, bool stop, std::string on_stop, double every_s = 5.0)
      : what_(std::move(what)), total_(std::max<int64_t>(total_steps, 1)), stop_(stop), on_stop_(std::move(on_stop)),
        every_(every_s) {
    std::fprintf(stderr, "%s: %lld solver steps\n", what_.c_str(), static_cast<long long>(total_));
    std::fflush(stderr);
  }
  void tick() {
    ++done_;
    if (stop_) throw_if_stopped(what_, on_stop_);
    if (seconds_since(last_) < every_ && done_ != total_) return;
    if (done_ == total_ && !printed_) return;  // a short sampling: the opening line is enough
    last_ = Clock::now();
    printed_ = true;
    const double spent = seconds_since(t0_);
    const double eta = spent / static_cast<double>(done_) * static_cast<double>(total_ - done_);
    std::fprintf(stderr, "%s: step %lld/%lld (%.0f%%), %s, ETA %s\n", what_.c_str(), static_cast<long long>(done_),
                 static_cast<long long>(total_), 100.0 * double(done_) / double(total_), human_time(spent).c_str(),
                 human_time(eta).c_str());
    std::fflush(stderr);
  }
  // `options` reporting to this progress.
  SampleOptions wrap(SampleOptions options) {
    options.on_model_call = [this] { tick(); };
    return options;
  }

 private:
  std::string what_;
  int64_t total_;
  bool stop_;
  std::string on_stop_;
  double every_;
  int64_t done_ = 0;
  bool printed_ = false;
  Clock::time_point t0_ = Clock::now(), last_ = Clock::now();
};

// How long a sampling of `images` images in chunks of at most `chunk` takes, in solver steps.
int64_t sampling_steps(int64_t images, int64_t chunk, const SampleOptions& s) {
  return (images + chunk - 1) / chunk * model_calls(s);
}

// Note [Per-step losses]
// Every step's loss and gradient norm are kept on the device: each step shifts two small f32
// buffers of `capacity` entries left by one and writes its values at the end (a clone and two
// copies per buffer, no host read), inside the captured graph of a --compile run as in an eager
// step. The loop reads the last n entries (one wait) at log lines, samples, checkpoints, the end,
// a stop, and whenever n reaches the capacity (min(--log-every, 1024)); loss.csv then gets a row
// per step and the loss plot every step's loss.
class StepLosses {
 public:
  StepLosses(int64_t capacity, const Device& dev)
      : cap_(capacity), losses_(Tensor::zeros({capacity}, {DType::f32, dev})), norms_(Tensor::zeros({capacity}, {DType::f32, dev})) {}
  int64_t capacity() const { return cap_; }
  void record(const Tensor& loss, const Tensor& norm) {
    push(losses_, loss);
    push(norms_, norm);
  }
  // The last n entries, oldest first: losses and gradient norms.
  std::pair<std::vector<double>, std::vector<double>> read(int64_t n) const {
    return {losses_.narrow(0, cap_ - n, n).to(Device::cpu()).to_vec<double>(),
            norms_.narrow(0, cap_ - n, n).to(Device::cpu()).to_vec<double>()};
  }

 private:
  void push(Tensor& buf, const Tensor& v) const {
    if (cap_ > 1) {
      const Tensor rest = buf.narrow(0, 1, cap_ - 1).clone();
      buf.narrow(0, 0, cap_ - 1).copy_(rest);
    }
    buf.narrow(0, cap_ - 1, 1).copy_(v.detach().to(DType::f32).reshape({1}));
  }
  int64_t cap_;
  Tensor losses_, norms_;
};

std::shared_ptr<const Dataset> load_training_data(const TrainConfig& c) {
  Dataset d = Dataset::load(find_data_dir(c.data_dir), Split::train);
  if (!c.classes.empty()) d = d.select_classes(c.classes);
  if (!c.exclude_classes.empty()) d = d.exclude_classes(c.exclude_classes);
  if (d.n < c.batch / c.accum)
    throw std::runtime_error("training data: " + std::to_string(d.n) + " images after the class filter, fewer than a batch of " +
                             std::to_string(c.batch / c.accum));
  return std::make_shared<const Dataset>(std::move(d));
}

// Labels for a grid: rows are classes, `per_class` columns each.
Tensor grid_labels(const std::vector<int>& classes, int64_t per_class, const Device& dev) {
  std::vector<int64_t> y;
  for (int c : classes)
    for (int64_t i = 0; i < per_class; ++i) y.push_back(c);
  return Tensor::from_vec(y, {static_cast<int64_t>(y.size())}).to(dev);
}

// The grid of `per_class` samples of each class, written to `path` (PNG or JPEG by its extension).
// `progress`: its label on stderr (SamplingProgress); `stop`: a stop signal ends it, saying `on_stop`.
void write_samples(DiffusionModel& model, const Objective& objective, const std::vector<int>& classes,
                   int64_t per_class, const SampleOptions& sampling, std::optional<DType> amp, const Device& dev,
                   const std::string& path, int scale, const std::string& progress, bool stop = false,
                   const std::string& on_stop = "") {
  const bool was_training = model.is_training();
  model.eval();
  Tensor images;
  {
    const int64_t n = static_cast<int64_t>(classes.size()) * per_class;
    SamplingProgress bar(progress + " (" + std::to_string(n) + " images)", sampling_steps(n, n, sampling), stop, on_stop);
    MaybeAutocast ac(amp, dev);
    images = sample(model, objective, grid_labels(classes, per_class, dev), bar.wrap(sampling));
  }
  model.train(was_training);
  std::vector<std::string> names;
  for (int c : classes) names.push_back(fashion_mnist_class_names().at(static_cast<std::size_t>(c)));
  save_grid(path, images.to(DType::f32),
                {.cols = static_cast<int>(per_class), .padding = 2, .scale = scale, .background = 0, .row_labels = names, .label_scale = 1});
}

// Samples `per_class` images of every class in `classes` (in chunks of at most 1000) and returns
// the fraction the classifier assigns to the class they were conditioned on; prints per-class
// fractions.
double class_fraction(DiffusionModel& model, const Objective& objective, const std::vector<int>& classes,
                      int64_t per_class, SampleOptions sampling, std::optional<DType> amp, const Device& dev,
                      const std::string& classifier_path, const std::string& on_stop) {
  auto clf = load_classifier(classifier_path, dev);
  const bool was_training = model.is_training();
  model.eval();
  SamplingProgress bar("classifier samples (" + std::to_string(per_class * static_cast<int64_t>(classes.size())) + " images)",
                       static_cast<int64_t>(classes.size()) * sampling_steps(per_class, 1000, sampling), true, on_stop);
  sampling = bar.wrap(sampling);
  int64_t hits = 0, total = 0;
  std::string per;
  for (int c : classes) {
    int64_t class_hits = 0;
    for (int64_t done = 0; done < per_class;) {
      const int64_t n = std::min<int64_t>(1000, per_class - done);
      const Tensor labels = grid_labels({c}, n, dev);
      Tensor images;
      {
        MaybeAutocast ac(amp, dev);
        images = sample(model, objective, labels, sampling);
      }
      sampling.seed += 1;
      class_hits += static_cast<int64_t>(std::llround(conditional_accuracy(*clf, images.to(DType::f32), labels) * double(n)));
      done += n;
    }
    hits += class_hits;
    total += per_class;
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%d:%.0f%%", per.empty() ? "" : " ", c, 100.0 * double(class_hits) / double(per_class));
    per += buf;
  }
  model.train(was_training);
  const double f = double(hits) / double(std::max<int64_t>(total, 1));
  std::printf("classifier %s: %.1f%% of %lld samples recognised as their class (%s)\n", classifier_path.c_str(),
              100.0 * f, static_cast<long long>(total), per.c_str());
  std::fflush(stdout);
  return f;
}

std::vector<int> all_classes(int64_t n) {
  std::vector<int> v;
  for (int c = 0; c < n; ++c) v.push_back(c);
  return v;
}

// The default LoRA targets of a model family: the DiT's attention and MLP projections, the
// UNet's attention projections.
std::vector<std::string> default_lora_targets(const std::string& preset) {
  if (preset.rfind("dit", 0) == 0) return {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"};
  return {"mid_attn.qkv", "mid_attn.proj"};
}

struct Run {
  TrainConfig cfg;
  Device dev = Device::cpu();
  std::optional<DType> amp;
  std::shared_ptr<DiffusionModel> model;
  std::unique_ptr<Objective> objective;
  flame::TensorList trainable;
  std::map<std::string, std::string> metadata;  // more checkpoint metadata (finetune: the adapter's)
};

// The first line of a message, at most 300 characters.
std::string first_line(const std::string& text) {
  std::string s = text.substr(0, text.find('\n'));
  if (s.size() > 300) s = s.substr(0, 300) + "...";
  return s;
}

// --resume (Note [Run directories]): loads the newest checkpoint of `dir` that loads. Every file
// passed over is named with the reason on stderr; when there were checkpoints and none loads, the
// run stops (it never starts from step 0 over a run it could not read). A checkpoint of another
// preset, objective or command is a mistake, not damage: one line says so.
std::optional<flame::CheckpointInfo> load_newest_checkpoint(flame::Checkpoint& ckpt, const std::string& dir, const Run& r,
                                                            const std::string& tag) {
  const std::vector<std::string> files = checkpoint_files(dir);
  std::string skipped;
  for (const std::string& path : files) {
    const std::string name = fs::path(path).filename().string();
    std::string why;
    try {
      const flame::CheckpointInfo head = flame::read_checkpoint_info(path);
      auto meta = [&](const char* key) {
        auto it = head.metadata.find(key);
        return it == head.metadata.end() ? std::string() : it->second;
      };
      if (!meta("model").empty() && meta("model") != r.model->preset()) {
        throw UsageError(path + " holds " + meta("model") + "; the run is " + r.model->preset() +
                         (tag == "train" ? " (--model): resume it with --model " + meta("model") : std::string(" (from --base)")) +
                         ", or train into another --out");
      }
      if (!meta("run").empty() && meta("run") != tag)
        throw UsageError(path + " is a " + meta("run") + " checkpoint; this is a " + tag + " run: use another --out");
      if (!meta("objective").empty() && meta("objective") != r.objective->name()) {
        throw UsageError(path + " was trained with the " + meta("objective") + " objective; the run is " +
                         r.objective->name() + ": resume it with --objective " + meta("objective"));
      }
      flame::CheckpointInfo info = ckpt.load(path);
      info.path = path;
      return info;
    } catch (const UsageError&) {
      throw;
    } catch (const std::exception& e) {
      why = first_line(e.what());
    }
    std::fprintf(stderr, "--resume: skipped %s: %s\n", path.c_str(), why.c_str());
    skipped += "\n  " + name + ": " + why;
  }
  if (!files.empty()) {
    throw std::runtime_error("--resume: none of the " + std::to_string(files.size()) + " checkpoints in " + dir +
                             " loads:" + skipped +
                             "\nThe run cannot continue from them; --overwrite (instead of --resume) starts it afresh.");
  }
  return std::nullopt;
}

// The loop shared by train and finetune. `tag` names the run in its outputs.
TrainResult run_loop(Run& r, const std::string& tag, const std::function<void(const std::string& dir)>& on_final) {
  const TrainConfig& c = r.cfg;
  if (c.batch <= 0 || c.accum <= 0 || c.batch % c.accum != 0)
    throw std::runtime_error("--batch " + std::to_string(c.batch) + " must be a positive multiple of --accum " +
                             std::to_string(c.accum));
  if (c.steps <= 0) throw std::runtime_error("--steps must be positive");
  if (c.log_every <= 0) throw std::runtime_error("--log-every must be a positive integer (got " + std::to_string(c.log_every) + ")");
  prepare_run_dir(c.out, c.resume, c.overwrite, tag);
  fs::create_directories(c.out);
  const std::string ckpt_dir = (fs::path(c.out) / "checkpoints").string();
  auto data = load_training_data(c);

  // --compile (Note [Compiled training step]): the step is captured into a CUDA graph, so the
  // optimizer and the EMA keep lr, step counts and the EMA's update count on the device.
  bool compile = c.compile && r.dev.is_cuda();
  if (compile && c.accum > 1) {
    std::fprintf(stderr, "--compile: not with gradient accumulation (--accum %lld); this run steps eagerly\n",
                 static_cast<long long>(c.accum));
    compile = false;
  }
  optim::AdamW opt(r.trainable, {.lr = c.lr, .weight_decay = c.weight_decay, .capturable = compile});
  optim::SchedulerPtr sched;
  if (c.schedule == "cosine") {
    sched = optim::warmup_cosine(opt, c.warmup, c.steps, c.lr * 0.1);
  } else if (c.schedule == "constant") {
    const int64_t warm = c.warmup;
    sched = std::make_shared<optim::LambdaLR>(
        opt, [warm](int64_t s) { return warm > 0 && s < warm ? double(s + 1) / double(warm) : 1.0; });
  } else {
    throw std::runtime_error("--schedule " + c.schedule + ": expected constant or cosine");
  }
  optim::EMA ema(r.trainable, {.decay = c.ema_decay, .warmup = c.ema_warmup, .capturable = compile});
  flame::Generator gen(c.seed * 7919 + 17);  // noise, times and label dropout

  flame::Checkpoint ckpt;
  ckpt.add("model", *r.model);
  ckpt.add("optimizer", opt);
  ckpt.add("scheduler", *sched);
  ckpt.add("ema", ema);
  ckpt.add_generator("train", gen);
  ckpt.set_metadata("model", r.model->preset());
  ckpt.set_metadata("objective", r.objective->name());
  ckpt.set_metadata("run", tag);
  for (const auto& [k, v] : r.metadata) ckpt.set_metadata(k, v);
  LoaderPosition start;
  if (c.resume) {
    if (const auto info = load_newest_checkpoint(ckpt, ckpt_dir, r, tag)) {
      const std::string* last = &info->path;
      start.epoch = ckpt.progress().counters["epoch"];
      start.batch = ckpt.progress().counters["batch"];
      // Saved by another number of ranks: the same fraction of the epoch (per-rank batches scale).
      const auto w = ckpt.progress().counters.find("world");
      if (w != ckpt.progress().counters.end() && w->second != dist_world()) start.batch = start.batch * w->second / dist_world();
      std::fprintf(stderr, "resumed from %s (step %lld)\n", last->c_str(), static_cast<long long>(info->step));
    } else {
      std::fprintf(stderr, "--resume: no checkpoint in %s, starting from step 0\n", ckpt_dir.c_str());
    }
  }
  // Multi-process (distributed.h): each rank its share of the data and of the batch.
  const int64_t world = dist_world();
  const bool main_rank = dist_rank() == 0;
  // The ranks would see a signal at different steps and wait for each other at the checkpoint's
  // barrier: a multi-process run keeps the default actions (flame-run ends every rank).
  if (world > 1) restore_default_stop_handlers();
  if (c.batch % (c.accum * world) != 0)
    throw std::runtime_error("--batch " + std::to_string(c.batch) + " must be a multiple of --accum x ranks (" +
                             std::to_string(c.accum * world) + ")");
  const int64_t micro = c.batch / c.accum / world;
  std::optional<flame::dist::DistributedSampler> sampler;
  if (world > 1) sampler.emplace(data->n, world, dist_rank(), true, c.seed);
  Loader loader(data, {.batch_size = micro, .seed = c.seed, .shuffle = true, .drop_last = true,
                       .random_flip = c.flip, .prefetch = 3, .device = r.dev, .host_transform = {}, .sampler = sampler},
                start);
  std::unique_ptr<flame::dist::DistributedDataParallel> ddp;  // after the resume: rank 0's weights
  if (world > 1) ddp = std::make_unique<flame::dist::DistributedDataParallel>(r.model);
  // Each rank its own noise, times and label dropout (a resumed run restores rank 0's stream).
  if (world > 1 && ckpt.progress().step == 0)
    gen.manual_seed(c.seed * 7919 + 17 + 1000003 * static_cast<uint64_t>(dist_rank()));

  const std::string csv_path =
      (fs::path(c.out) / (main_rank ? "loss.csv" : "loss.rank" + std::to_string(dist_rank()) + ".csv")).string();
  // A resumed run continues at the checkpoint's step: rows after it (steps the killed run did after
  // its last checkpoint) go, so no step appears twice.
  if (c.resume && ckpt.progress().step > 0) {
    if (const int64_t cut = truncate_loss_csv(csv_path, ckpt.progress().step))
      std::fprintf(stderr, "--resume: removed %lld rows after step %lld from %s\n", static_cast<long long>(cut),
                   static_cast<long long>(ckpt.progress().step), csv_path.c_str());
  }
  CsvLogger csv(csv_path, /*append=*/c.resume && ckpt.progress().step > 0);
  const std::string samples_path = (fs::path(c.out) / "samples.png").string();
  const std::string plot_path = (fs::path(c.out) / "loss.png").string();
  const auto classes = c.classes.empty() ? all_classes(r.model->num_classes()) : c.classes;

  if (c.short_attention) flame::cuda::set_short_attention(true);
  std::fprintf(stderr, "%s: %s (%lld parameters, %lld trainable), %s objective, %lld steps of %lld images%s on %s%s%s%s%s\n",
               tag.c_str(), r.model->preset().c_str(), static_cast<long long>(r.model->num_parameters()),
               static_cast<long long>(r.model->num_parameters(true)), r.objective->name().c_str(),
               static_cast<long long>(c.steps), static_cast<long long>(c.batch),
               c.accum > 1 ? (" (" + std::to_string(c.accum) + " micro-batches)").c_str() : "",
               r.dev.is_cuda() ? ("cuda:" + std::to_string(r.dev.index)).c_str() : "cpu",
               r.amp ? (std::string(", autocast ") + (r.amp == DType::bf16 ? "bf16" : "f16")).c_str() : "",
               compile ? ", compiled step (CUDA graph)" : "",
               c.recompute != "none" ? (", recompute " + c.recompute).c_str() : "",
               flame::cuda::short_attention() ? ", short-sequence attention kernels" : "");
  if (r.dev.is_cuda()) flame::cuda::reset_peak_memory_stats(r.dev.index);

  ProgressBar bar(c.steps, c.progress_bar && main_rank);
  TrainResult res;
  res.csv = csv_path;
  const auto t0 = Clock::now();
  const int64_t first = ckpt.progress().step;
  double window_loss = 0;
  int64_t window_n = 0;
  std::vector<double> plot_steps, plot_losses;
  if (c.resume && first > 0) {
    const LossLog old = read_loss_csv(csv_path);
    plot_steps = old.steps;
    plot_losses = old.losses;
  }
  r.model->train();
  int64_t& step = ckpt.progress().step;

  // Note [Compiled training step]
  // With --compile the whole step (label dropout, noise and timestep draws, forward under
  // autocast, backward, clipping, AdamW, EMA) is one cuda::GraphedStep: a few eager warm-up steps,
  // then one capture and a replay per step. The loader's batch is copied into static inputs
  // before each replay; the scheduler writes the next lr to the device between replays. Losses
  // are summed on the device into `loss_window` and read (one wait) only at log lines, so the CSV
  // gets one row per --log-every steps holding the window's mean loss and the last gradient norm.
  // The random streams are those of the eager loop (Note [Graph-safe RNG]), so a compiled run
  // follows the eager run up to floating-point reassociation. Under flame-run the graph holds
  // DDP's bucket all-reduces too (Note [Collectives in CUDA graphs] in src/dist/nccl_group.cpp);
  // each step is then handed to the process group's watchdog, which cannot see inside a replay.
  Tensor s_images, s_labels, s_loss, s_gnorm;
  StepLosses step_losses(std::min<int64_t>(c.log_every, 1024), r.dev);
  std::unique_ptr<flame::cuda::GraphedStep> graphed;
  std::function<void()> compiled_step;
  const int warmup_steps = 3;
  if (compile) {
    compiled_step = [&] {
          const Tensor y = drop_labels(s_labels, c.label_dropout, r.model->null_class(), &gen);
          Tensor loss;
          {
            MaybeAutocast ac(r.amp, r.dev);
            loss = r.objective->loss(*r.model, s_images, y, &gen);
          }
          flame::Gradients g = loss.backward();
          if (ddp) ddp->finish_gradients(g);  // the bucket all-reduces are part of the graph
          s_gnorm = c.grad_clip > 0 ? flame::clip_grad_norm(g, c.grad_clip) : flame::grad_norm(g);
          opt.step(g);
          ema.update();
          s_loss = loss.detach().to(DType::f32);
          step_losses.record(s_loss, s_gnorm);
        };
    graphed = std::make_unique<flame::cuda::GraphedStep>(
        compiled_step, flame::cuda::GraphedStepOptions{.warmup_steps = warmup_steps, .device = r.dev.index});
  }
  double last_loss = 0, last_gnorm = 0;
  // The learning rate and time of the steps whose losses are still on the device (Note [Per-step losses]).
  std::vector<double> pending_lr, pending_seconds;
  // Reads the pending steps' losses (one wait) and writes their rows.
  auto flush = [&] {
    const int64_t n = static_cast<int64_t>(pending_lr.size());
    if (n == 0) return;
    const auto [losses, norms] = step_losses.read(n);
    double sum = 0;
    int64_t bad = -1;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = step - n + 1 + i;
      csv.log(s, losses[i], pending_lr[i], norms[i], pending_seconds[i]);
      plot_steps.push_back(static_cast<double>(s));
      plot_losses.push_back(losses[i]);
      sum += losses[i];
      if (bad < 0 && !std::isfinite(losses[i])) bad = i;
    }
    last_loss = sum / static_cast<double>(n);
    last_gnorm = norms.back();
    window_loss += sum;
    window_n += n;
    pending_lr.clear();
    pending_seconds.clear();
    if (bad >= 0)
      throw std::runtime_error("training diverged at step " + std::to_string(step - n + 1 + bad) + ": loss " +
                               std::to_string(losses[bad]));
  };
  // After each step of either loop: the reads, the progress line, periodic samples and checkpoints,
  // the time limit and a stop signal (Note [Graceful stop]: the checkpoint of this step, then
  // Interrupted). True: the time limit ended the run.
  auto end_of_step = [&](double lr) -> bool {
    pending_lr.push_back(lr);
    pending_seconds.push_back(seconds_since(t0));
    const bool log_line = step % c.log_every == 0;
    const bool out_of_time = c.time_limit > 0 && seconds_since(t0) >= c.time_limit;
    const int signal = stop_signal();
    const bool last = step == c.steps || out_of_time || signal != 0;
    const bool sample_now = !last && c.sample_every > 0 && step % c.sample_every == 0;
    const bool ckpt_now = !last && c.ckpt_every > 0 && step % c.ckpt_every == 0;
    if (log_line || last || sample_now || ckpt_now || static_cast<int64_t>(pending_lr.size()) == step_losses.capacity())
      flush();
    const double elapsed = seconds_since(t0);
    const int64_t done = step - first;
    const double it_s = done / std::max(elapsed, 1e-9);
    if (main_rank)
      bar.update(step, last_loss, it_s, it_s * static_cast<double>(c.batch), (c.steps - step) / std::max(it_s, 1e-9),
                 gpu_bytes(r.dev, false), log_line);
    if (log_line) {
      res.final_loss = window_loss / static_cast<double>(std::max<int64_t>(window_n, 1));
      window_loss = 0;
      window_n = 0;
    }
    if (main_rank && sample_now) {
      auto swapped = ema.swap_in();
      write_samples(*r.model, *r.objective, classes, c.samples_per_class, c.sampling, r.amp, r.dev, samples_path, 2,
                    "samples at step " + std::to_string(step));
      write_loss_plot(plot_path, plot_steps, plot_losses);
    }
    if (ckpt_now) {
      dist_barrier();  // every rank finished the step; rank 0 writes (atomically)
      if (main_rank) res.last_checkpoint = ckpt.save_rotating(ckpt_dir, c.keep_checkpoints);
    }
    if (signal != 0) {
      res.last_checkpoint = ckpt.save_rotating(ckpt_dir, c.keep_checkpoints);
      if (main_rank && !plot_steps.empty()) write_loss_plot(plot_path, plot_steps, plot_losses);
      std::printf("  checkpoint: %s\n", fs::absolute(res.last_checkpoint).c_str());
      std::fflush(stdout);
      throw Interrupted(signal, signal_name(signal) + " at step " + std::to_string(step) + " of " +
                                    std::to_string(c.steps) + ": saved checkpoint " +
                                    fs::absolute(res.last_checkpoint).string() + "; the same command with --resume "
                                    "continues the run");
    }
    if (out_of_time)
      std::fprintf(stderr, "\n--time-limit %.0f s reached at step %lld\n", c.time_limit, static_cast<long long>(step));
    return out_of_time;
  };
  while (compile && step < c.steps) {
    Batch b = loader.next();
    if (!s_images.defined()) {
      s_images = Tensor::empty(b.images.sizes(), {b.images.dtype(), r.dev});
      s_labels = Tensor::empty(b.labels.sizes(), {b.labels.dtype(), r.dev});
    }
    flame::cuda::GraphedStep::copy_input(s_images, b.images);
    flame::cuda::GraphedStep::copy_input(s_labels, b.labels);
    const double lr = opt.lr();
    if (graphed) {
      const bool capturing_now = graphed->calls() >= warmup_steps && !graphed->captured();
      try {
        (*graphed)();
      } catch (const flame::Error& e) {
        // With several ranks a failed capture may have recorded some of DDP's collectives on this
        // rank only, and the ranks would decide on their own: stop, naming the cause, rather than
        // go on out of step with the others.
        if (!capturing_now || world > 1) throw;
        // A failed capture ran nothing: say why and go on with the same step function, eagerly.
        std::fprintf(stderr, "\n--compile: %s\n--compile: continuing without the CUDA graph\n", e.what());
        graphed.reset();
        compiled_step();
      }
    } else {
      compiled_step();
    }
    // A replay's all-reduces are invisible to the NCCL watchdog: bound the step by its timeout.
    if (world > 1) flame::dist::default_group().watch("compiled step " + std::to_string(step));
    sched->step();  // the next step's lr, written to the device (no wait)
    ++step;
    const LoaderPosition pos = loader.position();
    ckpt.progress().counters["epoch"] = pos.epoch;
    ckpt.progress().counters["batch"] = pos.batch;
    if (end_of_step(lr)) break;
  }
  while (!compile && step < c.steps) {
    flame::Gradients grads;
    Tensor loss_sum;  // on the device: read at log lines only (Note [Per-step losses])
    for (int64_t m = 0; m < c.accum; ++m) {
      std::optional<flame::dist::DistributedDataParallel::NoSync> no_sync;  // reduce on the last micro-batch only
      if (ddp && m + 1 < c.accum) no_sync.emplace(*ddp);
      Batch b = loader.next();
      const Tensor y = drop_labels(b.labels, c.label_dropout, r.model->null_class(), &gen);
      Tensor loss;
      {
        MaybeAutocast ac(r.amp, r.dev);
        loss = r.objective->loss(*r.model, b.images, y, &gen);
      }
      if (c.accum > 1) loss = loss * (1.0 / static_cast<double>(c.accum));
      flame::BackwardOptions bo;
      bo.accumulate_into = &grads;
      (void)loss.backward(bo);
      const Tensor l = loss.detach().to(DType::f32);
      loss_sum = loss_sum.defined() ? loss_sum + l : l;
    }
    if (ddp) ddp->finish_gradients(grads);  // every rank now holds the average over the ranks
    const Tensor gnorm = c.grad_clip > 0 ? flame::clip_grad_norm(grads, c.grad_clip) : flame::grad_norm(grads);
    const double lr = opt.lr();
    opt.step(grads);
    sched->step();
    ema.update(step);
    ++step;
    const LoaderPosition pos = loader.position();
    ckpt.progress().counters["epoch"] = pos.epoch;
    ckpt.progress().counters["batch"] = pos.batch;
    ckpt.progress().counters["world"] = world;
    step_losses.record(loss_sum, gnorm);
    if (end_of_step(lr)) break;
  }
  dist_barrier();
  if (!main_rank) return res;  // rank 0 writes the last checkpoint, samples and plots
  if (window_n > 0) res.final_loss = window_loss / static_cast<double>(window_n);
  if (r.dev.is_cuda()) flame::cuda::synchronize(r.dev.index);  // the queued steps count in the time
  res.seconds = seconds_since(t0);
  res.steps_done = step - first;
  res.images_per_second = static_cast<double>(res.steps_done * c.batch) / std::max(res.seconds, 1e-9);
  res.peak_gpu_bytes = gpu_bytes(r.dev, true);
  res.graph_replays = graphed ? graphed->replays() : 0;
  if (graphed && r.dev.is_cuda())
    std::fprintf(stderr, "\ncompiled step: %lld replays of one CUDA graph, graph pool %s\n",
                 static_cast<long long>(graphed->replays()),
                 human_bytes(double(flame::cuda::memory_stats(r.dev.index).graph_pool_bytes)).c_str());
  res.last_checkpoint = ckpt.save_rotating(ckpt_dir, c.keep_checkpoints);
  write_loss_plot(plot_path, plot_steps, plot_losses);
  {
    // The checkpoint, the loss curve and (finetune) the adapter are written before the samples, so
    // a stop signal during the sampling, which can take minutes on the CPU, loses nothing else.
    auto swapped = ema.swap_in();
    if (on_final) on_final(c.out);
    const std::string on_stop = "the checkpoint " + fs::absolute(res.last_checkpoint).string() +
                                " and the loss curve are saved; the samples were not written";
    write_samples(*r.model, *r.objective, classes, c.samples_per_class, c.sampling, r.amp, r.dev, samples_path, 2,
                  "final samples", /*stop=*/true, on_stop);
    if (!c.classifier.empty())
      res.class_fraction = class_fraction(*r.model, *r.objective, classes, c.eval_per_class, c.sampling, r.amp, r.dev,
                                          c.classifier, on_stop);
  }
  res.samples_png = samples_path;
  res.loss_png = plot_path;
  std::printf("%s done: %lld steps in %s (%.1f img/s), final loss %.4f%s\n"
              "  samples:    %s\n  loss curve: %s\n  log:        %s\n  checkpoint: %s\n",
              tag.c_str(), static_cast<long long>(res.steps_done), human_time(res.seconds).c_str(),
              res.images_per_second, res.final_loss,
              res.peak_gpu_bytes > 0 ? (", peak GPU memory " + human_bytes(double(res.peak_gpu_bytes))).c_str() : "",
              fs::absolute(samples_path).c_str(), fs::absolute(plot_path).c_str(), fs::absolute(csv_path).c_str(),
              fs::absolute(res.last_checkpoint).c_str());
  std::fflush(stdout);
  return res;
}

// The model of a plain weights file: PyTorch state-dict names, the preset in the metadata's
// "model" (what `export` and the PyTorch twin's trainer, reference/train.py, write).
std::shared_ptr<DiffusionModel> load_weights_file(const std::string& path, const flame::io::Metadata& meta,
                                                  const Device& dev, std::string* objective_name) {
  auto it = meta.find("model");
  if (it == meta.end())
    throw std::runtime_error(path + ": neither a flame-diffusion checkpoint nor a weights file naming its preset "
                             "(no \"flame.checkpoint\" or \"model\" in its metadata)");
  auto model = make_model(it->second, 0);
  model->to(dev);
  flame::nn::load_state_dict(*model, path);  // strict: names every missing, unexpected or mismatched key
  if (objective_name) {
    auto o = meta.find("objective");
    *objective_name = o == meta.end() ? "flow" : o->second;
  }
  return model;
}

// Note [Finetune checkpoints]
// A finetune run's checkpoint holds the base model with LoRA adapters (model.<layer>.lora_A/B
// keys) and an EMA of the adapters alone; its metadata names the adapter (lora_rank, lora_alpha,
// lora_targets, as lora.safetensors). load_model rebuilds the adapters from that metadata, loads
// the weights (the EMA'd adapters when use_ema) and merges them into the base weights, so `sample`
// and `export` take a finetune checkpoint like a train one; `export` then writes the merged weights
// without adapter keys, a plain state dict of the preset.
struct AdapterSpec {
  flame::nn::LoraOptions options;
  std::vector<std::string> targets;
};

// The adapter a checkpoint's or adapter file's metadata describes (nullopt: none). Raises naming
// the file when the entries are malformed.
std::optional<AdapterSpec> adapter_of(const std::map<std::string, std::string>& meta, const std::string& path) {
  auto get = [&](const char* key) -> std::optional<std::string> {
    auto it = meta.find(key);
    return it == meta.end() ? std::nullopt : std::optional<std::string>(it->second);
  };
  const auto rank = get("lora_rank"), alpha = get("lora_alpha"), targets = get("lora_targets");
  if (!rank && !alpha && !targets) return std::nullopt;
  const std::optional<int64_t> r = rank ? parse_int64(*rank) : std::nullopt;
  const std::optional<double> a = alpha ? parse_finite(*alpha) : std::nullopt;
  if (!r || *r < 1 || !a || !targets || targets->empty())
    throw std::runtime_error(path + ": its adapter metadata is incomplete or malformed (lora_rank '" + rank.value_or("") +
                             "', lora_alpha '" + alpha.value_or("") + "', lora_targets '" + targets.value_or("") + "')");
  AdapterSpec spec;
  spec.options.rank = *r;
  spec.options.alpha = *a;
  std::stringstream ts(*targets);
  for (std::string t; std::getline(ts, t, ',');) spec.targets.push_back(t);
  return spec;
}

// The model a checkpoint was trained as, with its weights (the EMA weights when `use_ema`), or the
// model of a plain weights file. A finetune checkpoint's adapter is merged into the weights (Note
// [Finetune checkpoints]); *adapted says whether there was one.
std::shared_ptr<DiffusionModel> load_model(const std::string& path, const Device& dev, bool use_ema,
                                           std::string* objective_name, bool* adapted = nullptr) {
  if (adapted) *adapted = false;
  const flame::io::Metadata meta = flame::io::load_safetensors_metadata(path);
  if (!meta.count("flame.checkpoint")) return load_weights_file(path, meta, dev, objective_name);
  const flame::CheckpointInfo info = flame::read_checkpoint_info(path);
  auto it = info.metadata.find("model");
  if (it == info.metadata.end())
    throw std::runtime_error(path + ": not a flame-diffusion checkpoint (no \"model\" in its metadata)");
  auto model = make_model(it->second, 0);
  model->to(dev);
  if (objective_name) {
    auto o = info.metadata.find("objective");
    *objective_name = o == info.metadata.end() ? "flow" : o->second;
  }
  const std::optional<AdapterSpec> adapter = adapter_of(info.metadata, path);
  auto run = info.metadata.find("run");
  if (!adapter && run != info.metadata.end() && run->second == "finetune") {
    throw std::runtime_error(path + ": a finetune checkpoint that does not describe its adapter (written before "
                             "checkpoints carried lora_rank/lora_alpha/lora_targets): sample the base checkpoint with "
                             "--lora <run>/lora.safetensors instead");
  }
  if (adapter) flame::nn::apply_lora(*model, adapter->options, adapter->targets);
  // The EMA covers what the run trained: every parameter, or a finetune's adapters (apply_lora froze the rest).
  flame::TensorList trained;
  for (const Tensor& p : model->parameters())
    if (!adapter || p.requires_grad()) trained.push_back(p);
  optim::EMA ema(trained, {.decay = 0.999});
  flame::Checkpoint ckpt;
  ckpt.exclude_default_generator();
  ckpt.add("model", *model);
  const bool has_ema = std::find(info.components.begin(), info.components.end(), "ema") != info.components.end();
  if (use_ema && has_ema) ckpt.add("ema", ema);
  ckpt.load(path, {.strict = false});
  if (use_ema && has_ema) ema.copy_to();
  if (adapter) {
    flame::nn::merge_lora(*model);
    if (adapted) *adapted = true;
  }
  return model;
}

// --recompute: a DiT setting; other models have nothing to recompute and say so.
void apply_recompute(DiffusionModel& model, const std::string& level) {
  const DiTRecomputeSpec r = parse_dit_recompute_spec(level);
  if (auto* dit = dynamic_cast<DiT*>(&model)) {
    dit->set_recompute(r);
  } else if (r.level != DiTRecompute::none) {
    throw std::runtime_error("--recompute " + level + ": only DiT models recompute activations; " +
                             model.preset() + " is not one");
  }
}

}  // namespace

TrainResult train(const TrainConfig& config) {
  Run r;
  r.cfg = config;
  r.dev = init_distributed(parse_device(config.device));
  r.amp = autocast_dtype(config.amp, r.dev);
  flame::manual_seed(config.seed);
  r.model = make_model(config.model, config.seed);
  apply_recompute(*r.model, config.recompute);
  r.model->to(r.dev);
  r.objective = make_objective(config.objective);
  r.trainable = r.model->parameters();
  TrainResult res = run_loop(r, "train", nullptr);
  finish_distributed();
  return res;
}

// --lora-rank: at most the smaller width of every adapted layer. The update B A of a layer with
// in_features x out_features weights has rank at most min(in, out), so a larger rank adds parameters
// (rank x (in + out) per layer) but no expressive power; a full fine-tune of the layer is that bound.
void check_lora_rank(DiffusionModel& model, const std::vector<std::string>& targets, int64_t rank) {
  int64_t bound = std::numeric_limits<int64_t>::max();
  std::string where;
  for (const auto& [name, p] : model.named_parameters()) {
    if (p.dim() != 2 || name.size() < 7 || name.compare(name.size() - 7, 7, ".weight") != 0) continue;
    const std::string layer = name.substr(0, name.size() - 7);
    const bool targeted = std::any_of(targets.begin(), targets.end(), [&](const std::string& t) {
      return layer == t || (layer.size() > t.size() && layer.compare(layer.size() - t.size() - 1, t.size() + 1, "." + t) == 0);
    });
    if (!targeted) continue;
    const int64_t w = std::min(p.size(0), p.size(1));
    if (w < bound) {
      bound = w;
      where = layer + " (" + std::to_string(p.size(1)) + " -> " + std::to_string(p.size(0)) + ")";
    }
  }
  if (where.empty() || rank <= bound) return;  // no target matched: apply_lora names the targets
  throw UsageError("--lora-rank " + std::to_string(rank) + " is larger than the adapted layers allow: " + model.preset() +
                   "'s " + where + " has rank at most " + std::to_string(bound) +
                   ", and an adapter of a higher rank adds parameters but no expressive power (its update B·A "
                   "already has full rank); use --lora-rank 1 to " + std::to_string(bound));
}

TrainResult finetune(const TrainConfig& config) {
  if (config.base_checkpoint.empty()) throw std::runtime_error("finetune: --base CKPT is required");
  Run r;
  r.cfg = config;
  r.dev = parse_device(config.device);
  r.amp = autocast_dtype(config.amp, r.dev);
  flame::manual_seed(config.seed);
  std::string objective;
  r.model = load_model(config.base_checkpoint, r.dev, /*use_ema=*/true, &objective);
  apply_recompute(*r.model, config.recompute);
  r.cfg.model = r.model->preset();
  r.objective = make_objective(objective);
  const auto targets = config.lora_targets.empty() ? default_lora_targets(r.model->preset()) : config.lora_targets;
  check_lora_rank(*r.model, targets, config.lora_rank);
  const auto adapted = flame::nn::apply_lora(*r.model, {.rank = config.lora_rank, .alpha = config.lora_alpha}, targets);
  {
    std::string joined;
    for (const auto& t : targets) joined += (joined.empty() ? "" : ",") + t;
    r.metadata = {{"lora_rank", std::to_string(config.lora_rank)},
                  {"lora_alpha", std::to_string(config.lora_alpha)},
                  {"lora_targets", joined}};
  }
  for (auto& p : r.model->parameters())
    if (p.requires_grad()) r.trainable.push_back(p);
  std::fprintf(stderr, "finetune: %zu layers adapted (rank %lld), base %s\n", adapted.size(),
               static_cast<long long>(config.lora_rank), config.base_checkpoint.c_str());
  return run_loop(r, "finetune", [&](const std::string& dir) {
    const std::string path = (fs::path(dir) / "lora.safetensors").string();
    std::string joined;
    for (const auto& t : targets) joined += (joined.empty() ? "" : ",") + t;
    flame::nn::save_lora(*r.model, path,
                         {{"base_model", r.model->preset()}, {"lora_rank", std::to_string(config.lora_rank)},
                          {"lora_alpha", std::to_string(config.lora_alpha)}, {"lora_targets", joined}});
    std::printf("  adapter:    %s\n", fs::absolute(path).c_str());
    std::fflush(stdout);
  });
}

// An output file's folder must exist (checked before the work).
void check_output_folder(const std::string& path, const std::string& flag) {
  const fs::path p(path);
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  std::error_code ec;
  if (fs::is_directory(p, ec)) throw std::runtime_error(flag + " " + path + " is a folder; give a file name");
  if (!fs::is_directory(dir, ec))
    throw std::runtime_error(flag + " " + path + ": the folder " + dir.string() + " does not exist (create it first)");
}

void export_weights(const ExportConfig& config) {
  check_output_folder(config.out, "--out");
  std::string objective;
  bool adapted = false;
  auto model = load_model(config.checkpoint, Device::cpu(), config.use_ema, &objective, &adapted);
  // A finetune checkpoint's adapters are merged (Note [Finetune checkpoints]): their keys go.
  flame::StateDict dict;
  int64_t count = 0;
  const flame::StateDict all = model->state_dict();
  for (const auto& [name, t] : all) {
    if (flame::nn::is_lora_key(name)) continue;
    dict.insert(name, t);
    count += t.numel();
  }
  flame::io::save_safetensors(config.out, dict, {{"format", "pt"}, {"model", model->preset()}, {"objective", objective}});
  std::printf("%s (%s weights%s, %lld values) -> %s\n", model->preset().c_str(), config.use_ema ? "EMA" : "raw",
              adapted ? ", LoRA adapter merged" : "", static_cast<long long>(count), fs::absolute(config.out).c_str());
  std::fflush(stdout);
}

void sample_checkpoint(const SampleConfig& config) {
  check_output_image_path(config.out, "--out");  // before minutes of sampling
  const Device dev = parse_device(config.device);
  std::string objective_name;
  bool adapted = false;
  auto model = load_model(config.checkpoint, dev, config.use_ema, &objective_name, &adapted);
  if (adapted && !config.lora.empty()) {
    throw UsageError("--lora " + config.lora + ": " + config.checkpoint +
                     " is a finetune checkpoint, whose adapter is already applied; give --lora with the base checkpoint");
  }
  if (!config.lora.empty()) {
    // The adapter's rank, alpha and targets are in its metadata (finetune writes them).
    const flame::io::Metadata meta = flame::io::load_safetensors_metadata(config.lora);
    auto get = [&](const char* key) {
      auto it = meta.find(key);
      if (it == meta.end()) throw std::runtime_error(config.lora + ": no \"" + key + "\" in its metadata (not a flame-diffusion adapter)");
      return it->second;
    };
    if (get("base_model") != model->preset())
      throw std::runtime_error(config.lora + ": an adapter for " + get("base_model") + ", the checkpoint is " + model->preset());
    std::vector<std::string> targets;
    std::stringstream ts(get("lora_targets"));
    for (std::string t; std::getline(ts, t, ',');) targets.push_back(t);
    flame::nn::apply_lora(*model, {.rank = std::stoll(get("lora_rank")), .alpha = std::stod(get("lora_alpha"))}, targets);
    flame::nn::load_lora(*model, config.lora);
  }
  const auto objective = make_objective(objective_name);
  const auto classes = config.classes.empty() ? all_classes(model->num_classes()) : config.classes;
  write_samples(*model, *objective, classes, config.per_class, config.sampling,
                dev.is_cuda() ? std::optional<DType>(DType::bf16) : std::nullopt, dev, config.out, config.scale,
                "sampling", /*stop=*/true, "nothing was written");
  if (!config.classifier.empty()) {
    const std::optional<DType> amp = dev.is_cuda() ? std::optional<DType>(DType::bf16) : std::nullopt;
    class_fraction(*model, *objective, classes, config.per_class, config.sampling, amp, dev, config.classifier,
                   "the grid " + fs::absolute(config.out).string() + " is written");
  }
  std::printf("wrote %s (%zu classes x %lld, %s %lld steps, cfg %.1f)\n", fs::absolute(config.out).c_str(),
              classes.size(), static_cast<long long>(config.per_class), sampler_name(config.sampling.sampler).c_str(),
              static_cast<long long>(config.sampling.steps), config.sampling.cfg_scale);
  std::fflush(stdout);
}

}  // namespace flame_diffusion
