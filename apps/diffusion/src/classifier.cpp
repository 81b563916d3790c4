#include "classifier.h"

#include <flame/amp.h>
#include <flame/io/safetensors.h>
#include <flame/optim/optimizers.h>
#include <flame/optim/scheduler.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>

#include "trainer.h"  // parse_device

namespace flame_diffusion {

using flame::Device;
using flame::DType;
using flame::Tensor;
namespace nn = flame::nn;
namespace optim = flame::optim;

namespace {

constexpr const char* kFormat = "flame-diffusion-classifier";

std::vector<int64_t> parse_int_list(const std::string& text, const std::string& what) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string part;
  while (std::getline(ss, part, ',')) {
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos)
      throw std::runtime_error(what + ": '" + part + "' is not a positive integer");
    out.push_back(std::stoll(part));
  }
  return out;
}

// splitmix64: the augmentation draws of a batch are a pure function of (seed, epoch, batch), as the
// loader's flips are (Note [Loader determinism] in data.h), whatever the prefetch timing.
uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Random translation by up to `pad` pixels in each direction, the background (-1) filling the
// uncovered border: the same as a random crop of the image padded by `pad`, without the copy.
void random_shift(Tensor& images, uint64_t seed, LoaderPosition pos, int64_t pad) {
  const int64_t b = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  uint64_t state = seed ^ (static_cast<uint64_t>(pos.epoch) * 0x9e3779b97f4a7c15ull) ^
                   (static_cast<uint64_t>(pos.batch) * 0xc2b2ae3d27d4eb4full) ^ 0x5817ull;
  float* data = images.data<float>();
  std::vector<float> tmp(static_cast<std::size_t>(h * w));
  for (int64_t k = 0; k < b; ++k) {
    const uint64_t r = splitmix(state);
    const int64_t dy = static_cast<int64_t>(r % static_cast<uint64_t>(2 * pad + 1)) - pad;
    const int64_t dx = static_cast<int64_t>((r >> 32) % static_cast<uint64_t>(2 * pad + 1)) - pad;
    if (dx == 0 && dy == 0) continue;
    for (int64_t ch = 0; ch < c; ++ch) {
      float* img = data + (k * c + ch) * h * w;
      for (int64_t y = 0; y < h; ++y) {
        for (int64_t x = 0; x < w; ++x) {
          const int64_t sy = y + dy, sx = x + dx;
          tmp[static_cast<std::size_t>(y * w + x)] = (sy >= 0 && sy < h && sx >= 0 && sx < w) ? img[sy * w + sx] : -1.0f;
        }
      }
      std::copy(tmp.begin(), tmp.end(), img);
    }
  }
}

// The first n samples of a data set (n <= 0 or >= size: all of it).
std::shared_ptr<const Dataset> head(Dataset d, int64_t n) {
  if (n > 0 && n < d.n) {
    d.images.resize(static_cast<std::size_t>(n * d.image_size()));
    d.labels.resize(static_cast<std::size_t>(n));
    d.n = n;
  }
  return std::make_shared<const Dataset>(std::move(d));
}

Device model_device(const nn::Module& m) {
  const auto params = m.parameters();
  return params.empty() ? Device::cpu() : params.front().device();
}

std::optional<DType> amp_dtype(const std::string& amp, const Device& dev) {
  if (amp == "off") return std::nullopt;
  if (amp == "bf16") return DType::bf16;
  if (amp == "auto") return dev.is_cuda() ? std::optional<DType>(DType::bf16) : std::nullopt;
  throw std::runtime_error("--amp " + amp + ": expected auto, bf16 or off");
}

std::string shape_str(const flame::Shape& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + "]";
}
std::string shape_str(const Tensor& t) { return t.defined() ? shape_str(t.sizes()) : "(undefined)"; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

}  // namespace

// ---- architecture ----

std::string ClassifierArch::to_string() const {
  std::string s = "resnet widths=";
  for (std::size_t i = 0; i < widths.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(widths[i]);
  }
  s += " blocks=" + std::to_string(blocks) + " classes=" + std::to_string(num_classes) +
       " in=" + std::to_string(in_channels);
  return s;
}

ClassifierArch ClassifierArch::parse(const std::string& text) {
  std::stringstream ss(text);
  std::string word;
  ss >> word;
  if (word != "resnet") throw std::runtime_error("classifier architecture '" + text + "': expected 'resnet ...'");
  ClassifierArch a;
  bool have_widths = false;
  while (ss >> word) {
    const auto eq = word.find('=');
    if (eq == std::string::npos) throw std::runtime_error("classifier architecture '" + text + "': bad field '" + word + "'");
    const std::string key = word.substr(0, eq), value = word.substr(eq + 1);
    const std::string what = "classifier architecture '" + text + "' " + key;
    if (key == "widths") {
      a.widths = parse_int_list(value, what);
      have_widths = true;
    } else {
      const auto v = parse_int_list(value, what);
      if (v.size() != 1) throw std::runtime_error(what + ": expected one integer");
      if (key == "blocks") a.blocks = v[0];
      else if (key == "classes") a.num_classes = v[0];
      else if (key == "in") a.in_channels = v[0];
      else throw std::runtime_error(what + ": unknown field");
    }
  }
  if (!have_widths || a.widths.empty()) throw std::runtime_error("classifier architecture '" + text + "': no widths");
  for (int64_t w : a.widths)
    if (w <= 0) throw std::runtime_error("classifier architecture '" + text + "': widths must be positive");
  if (a.blocks <= 0 || a.num_classes <= 1 || a.in_channels <= 0)
    throw std::runtime_error("classifier architecture '" + text + "': blocks, classes and in must be positive (classes >= 2)");
  return a;
}

// ---- modules ----

BasicBlock::BasicBlock(int64_t in_channels, int64_t out_channels, int64_t stride) {
  conv1_ = register_module("conv1", std::make_shared<nn::Conv2d>(in_channels, out_channels, flame::Shape{3},
                                                                  flame::Shape{stride}, 1, flame::Shape{1}, 1, false));
  bn1_ = register_module("bn1", std::make_shared<nn::BatchNorm2d>(out_channels));
  conv2_ = register_module("conv2", std::make_shared<nn::Conv2d>(out_channels, out_channels, flame::Shape{3},
                                                                  flame::Shape{1}, 1, flame::Shape{1}, 1, false));
  bn2_ = register_module("bn2", std::make_shared<nn::BatchNorm2d>(out_channels));
  if (stride != 1 || in_channels != out_channels) {
    downsample_ = register_module(
        "downsample",
        std::make_shared<nn::Sequential>(std::initializer_list<nn::ModulePtr>{
            std::make_shared<nn::Conv2d>(in_channels, out_channels, flame::Shape{1}, flame::Shape{stride}, 0,
                                         flame::Shape{1}, 1, false),
            std::make_shared<nn::BatchNorm2d>(out_channels)}));
  }
}

Tensor BasicBlock::forward(const Tensor& x) {
  Tensor y = bn1_->forward(conv1_->forward(x)).relu();
  y = bn2_->forward(conv2_->forward(y));
  const Tensor skip = downsample_ ? downsample_->forward(x) : x;
  return (y + skip).relu();
}

Classifier::Classifier(ClassifierArch arch) : arch_(std::move(arch)) {
  if (arch_.widths.empty() || arch_.blocks <= 0 || arch_.num_classes <= 1 || arch_.in_channels <= 0)
    throw std::runtime_error("Classifier: bad architecture '" + arch_.to_string() + "'");
  conv1_ = register_module("conv1", std::make_shared<nn::Conv2d>(arch_.in_channels, arch_.widths[0], flame::Shape{3},
                                                                  flame::Shape{1}, 1, flame::Shape{1}, 1, false));
  bn1_ = register_module("bn1", std::make_shared<nn::BatchNorm2d>(arch_.widths[0]));
  int64_t in = arch_.widths[0];
  for (std::size_t s = 0; s < arch_.widths.size(); ++s) {
    auto layer = std::make_shared<nn::Sequential>();
    for (int64_t b = 0; b < arch_.blocks; ++b) {
      const int64_t stride = (s > 0 && b == 0) ? 2 : 1;
      layer->push_back(std::make_shared<BasicBlock>(in, arch_.widths[s], stride));
      in = arch_.widths[s];
    }
    layers_.push_back(register_module("layer" + std::to_string(s + 1), layer));
  }
  fc_ = register_module("fc", std::make_shared<nn::Linear>(in, arch_.num_classes));
}

Tensor Classifier::forward(const Tensor& x) {
  if (x.dim() != 4 || x.size(1) != arch_.in_channels) {
    throw std::runtime_error("Classifier: expected images [N, " + std::to_string(arch_.in_channels) +
                             ", H, W], got " + shape_str(x));
  }
  Tensor y = bn1_->forward(conv1_->forward(x)).relu();
  for (auto& layer : layers_) y = layer->forward(y);
  y = y.mean({2, 3});  // global average pool
  return fc_->forward(y);
}

// ---- training ----

ClassifierTrainResult train_classifier_on(std::shared_ptr<Classifier> model, std::shared_ptr<const Dataset> train,
                                          std::shared_ptr<const Dataset> test, const ClassifierTrainOptions& o,
                                          Device device) {
  if (!model || !train) throw std::runtime_error("train_classifier: no model or no training data");
  if (o.epochs <= 0) throw std::runtime_error("--epochs must be positive (got " + std::to_string(o.epochs) + ")");
  if (o.batch <= 0) throw std::runtime_error("--batch must be positive (got " + std::to_string(o.batch) + ")");
  if (!(o.lr > 0)) throw std::runtime_error("--lr must be positive");
  if (o.batch > train->n)
    throw std::runtime_error("--batch " + std::to_string(o.batch) + " is larger than the training set (" +
                             std::to_string(train->n) + " images)");
  const auto amp = amp_dtype(o.amp, device);
  model->to(device);
  model->train();

  // Weight decay on the conv and linear weights only (not on BN scales and shifts or biases).
  flame::TensorList decay, no_decay;
  for (const Tensor& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  std::unique_ptr<optim::Optimizer> opt;
  double max_momentum = 0.95;
  if (o.optimizer == "sgd") {
    optim::SGDOptions so{.lr = o.lr, .momentum = o.momentum, .weight_decay = o.weight_decay, .nesterov = true};
    optim::ParamGroup nd = so.group(no_decay);
    nd.weight_decay = 0;
    opt = std::make_unique<optim::SGD>(std::vector<optim::ParamGroup>{so.group(decay), nd}, so);
    max_momentum = o.momentum;
  } else if (o.optimizer == "adamw") {
    optim::AdamWOptions ao{.lr = o.lr, .weight_decay = o.weight_decay};
    optim::ParamGroup nd = ao.group(no_decay);
    nd.weight_decay = 0;
    opt = std::make_unique<optim::AdamW>(std::vector<optim::ParamGroup>{ao.group(decay), nd}, ao);
  } else {
    throw std::runtime_error("--optimizer " + o.optimizer + ": expected sgd or adamw");
  }

  LoaderOptions lo;
  lo.batch_size = o.batch;
  lo.seed = o.seed;
  lo.shuffle = true;
  lo.drop_last = true;
  lo.random_flip = o.augment;
  lo.prefetch = 3;
  lo.device = device;
  if (o.augment) {
    const uint64_t seed = o.seed;
    lo.host_transform = [seed](Tensor& images, Tensor&, LoaderPosition pos) { random_shift(images, seed, pos, 2); };
  }
  Loader loader(train, lo);
  const int64_t steps_per_epoch = loader.batches_per_epoch();

  optim::OneCycleOptions oc;
  oc.max_lr = {o.lr};
  oc.total_steps = o.epochs * steps_per_epoch;
  oc.pct_start = 0.25;
  oc.cycle_momentum = true;
  oc.base_momentum = std::min(0.85, max_momentum);
  oc.max_momentum = max_momentum;
  optim::OneCycleLR sched(*opt, oc);

  if (o.verbose)
    std::fprintf(stderr, "classifier: %s, %lld parameters, %lld images x %lld epochs (batch %lld, %s lr %g)%s on %s\n",
                 model->arch().to_string().c_str(), static_cast<long long>(model->num_parameters()),
                 static_cast<long long>(train->n), static_cast<long long>(o.epochs), static_cast<long long>(o.batch),
                 o.optimizer.c_str(), o.lr, amp ? ", autocast bf16" : "",
                 device.is_cuda() ? ("cuda:" + std::to_string(device.index)).c_str() : "cpu");

  ClassifierTrainResult res;
  res.model = model;
  const auto t_start = Clock::now();
  for (int64_t epoch = 1; epoch <= o.epochs; ++epoch) {
    const auto t0 = Clock::now();
    model->train();
    // Sums kept on the device: one host read per epoch, not per step.
    Tensor loss_sum = Tensor::zeros({}, {DType::f32, device});
    Tensor correct = Tensor::zeros({}, {DType::i64, device});
    int64_t seen = 0;
    for (int64_t i = 0; i < steps_per_epoch; ++i) {
      Batch b = loader.next();
      Tensor logits, loss;
      {
        std::optional<flame::amp::AutocastGuard> ac;
        if (amp) ac.emplace(*amp, device.is_cuda() ? flame::DeviceType::cuda : flame::DeviceType::cpu);
        logits = model->forward(b.images);
        loss = flame::cross_entropy(logits, b.labels, flame::Reduction::mean, -100, o.label_smoothing);
      }
      flame::Gradients grads = loss.backward();
      opt->step(grads);
      sched.step();
      flame::NoGradGuard no_grad;
      loss_sum.add_(loss.detach().to(DType::f32));
      correct.add_(logits.detach().to(DType::f32).argmax(1).eq(b.labels).to(DType::i64).sum());
      seen += b.labels.size(0);
    }
    ClassifierEpoch e;
    e.epoch = epoch;
    e.loss = loss_sum.item<double>() / static_cast<double>(steps_per_epoch);
    e.train_accuracy = static_cast<double>(correct.item<int64_t>()) / static_cast<double>(seen);
    const double train_seconds = seconds_since(t0);  // the reads above waited for the last step
    if (test) e.test_accuracy = evaluate(*model, test);
    e.seconds = seconds_since(t0);
    res.epochs.push_back(e);
    if (o.verbose) {
      std::fprintf(stderr, "epoch %3lld/%lld  loss %.4f  train %.2f%%", static_cast<long long>(epoch),
                   static_cast<long long>(o.epochs), e.loss, 100.0 * e.train_accuracy);
      if (test) std::fprintf(stderr, "  test %.2f%%", 100.0 * e.test_accuracy);
      std::fprintf(stderr, "  %.1f s (%.0f img/s)\n", e.seconds, static_cast<double>(seen) / std::max(train_seconds, 1e-9));
    }
  }
  model->eval();
  res.test_accuracy = res.epochs.back().test_accuracy;
  res.seconds = seconds_since(t_start);
  return res;
}

ClassifierTrainResult train_classifier(const ClassifierTrainOptions& o) {
  const Device device = parse_device(o.device);
  const std::string dir = find_data_dir(o.data_dir);
  auto train = head(Dataset::load(dir, Split::train), o.train_limit);
  auto test = head(Dataset::load(dir, Split::test), o.test_limit);
  if (train->rows != test->rows || train->cols != test->cols)
    throw std::runtime_error("Fashion-MNIST in " + dir + ": train and test image sizes differ");
  flame::manual_seed(o.seed);
  auto model = std::make_shared<Classifier>(o.arch);
  ClassifierTrainResult res = train_classifier_on(model, train, test, o, device);
  if (!o.out.empty()) {
    char acc[32];
    std::snprintf(acc, sizeof acc, "%.4f", res.test_accuracy);
    save_classifier(*model, o.out,
                    {{"test_accuracy", acc},
                     {"epochs", std::to_string(o.epochs)},
                     {"train_images", std::to_string(train->n)},
                     {"test_images", std::to_string(test->n)}});
    res.path = o.out;
  }
  return res;
}

// ---- inference ----

double evaluate(Classifier& model, std::shared_ptr<const Dataset> data, int64_t batch) {
  if (!data || data->n == 0) throw std::runtime_error("evaluate: empty data set");
  if (batch <= 0) throw std::runtime_error("evaluate: batch must be positive");
  const Device device = model_device(model);
  model.eval();
  flame::NoGradGuard no_grad;
  LoaderOptions lo;
  lo.batch_size = std::min(batch, data->n);
  lo.shuffle = false;
  lo.drop_last = false;
  lo.prefetch = 2;
  lo.device = device;
  Loader loader(data, lo);
  Tensor correct = Tensor::zeros({}, {DType::i64, device});
  for (int64_t i = 0; i < loader.batches_per_epoch(); ++i) {
    Batch b = loader.next();
    correct.add_(model.forward(b.images).argmax(1).eq(b.labels).to(DType::i64).sum());
  }
  return static_cast<double>(correct.item<int64_t>()) / static_cast<double>(data->n);
}

double evaluate(Classifier& model, const Dataset& data, int64_t batch) {
  return evaluate(model, std::make_shared<const Dataset>(data), batch);
}

Tensor classify(Classifier& model, const Tensor& images, int64_t batch) {
  if (!images.defined() || images.dim() != 4 || images.size(1) != model.arch().in_channels) {
    throw std::runtime_error("classify: expected images [N, " + std::to_string(model.arch().in_channels) +
                             ", H, W], got " + shape_str(images));
  }
  if (batch <= 0) throw std::runtime_error("classify: batch must be positive");
  const Device device = model_device(model);
  model.eval();
  flame::NoGradGuard no_grad;
  const int64_t n = images.size(0);
  if (n == 0) return Tensor::zeros({0}, {DType::i64, images.device()});
  flame::TensorList parts;
  for (int64_t s = 0; s < n; s += batch) {
    const Tensor x = images.narrow(0, s, std::min(batch, n - s)).to(DType::f32, device);
    parts.push_back(model.forward(x).argmax(1));
  }
  Tensor preds = parts.size() == 1 ? parts[0] : flame::cat(parts, 0);
  return preds.to(DType::i64).to(images.device());
}

double conditional_accuracy(const Tensor& predictions, const Tensor& labels) {
  if (!predictions.defined() || !labels.defined() || predictions.dim() != 1 || labels.dim() != 1 ||
      predictions.size(0) != labels.size(0)) {
    throw std::runtime_error("conditional_accuracy: predictions and labels must be 1-d of the same size, got " +
                             shape_str(predictions) + " and " + shape_str(labels));
  }
  const int64_t n = predictions.size(0);
  if (n == 0) throw std::runtime_error("conditional_accuracy: no samples");
  const auto p = predictions.to_vec<int64_t>();
  const auto l = labels.to_vec<int64_t>();
  int64_t hit = 0;
  for (int64_t i = 0; i < n; ++i) hit += p[static_cast<std::size_t>(i)] == l[static_cast<std::size_t>(i)];
  return static_cast<double>(hit) / static_cast<double>(n);
}

double conditional_accuracy(Classifier& classifier, const Tensor& images, const Tensor& labels) {
  if (images.defined() && labels.defined() && images.dim() >= 1 && labels.dim() == 1 &&
      images.size(0) != labels.size(0)) {
    throw std::runtime_error("conditional_accuracy: " + std::to_string(images.size(0)) + " images but " +
                             std::to_string(labels.size(0)) + " labels");
  }
  return conditional_accuracy(classify(classifier, images), labels);
}

std::vector<double> per_class_accuracy(const Tensor& predictions, const Tensor& labels, int64_t num_classes) {
  (void)conditional_accuracy(predictions, labels);  // shape checks
  const auto p = predictions.to_vec<int64_t>();
  const auto l = labels.to_vec<int64_t>();
  std::vector<int64_t> hit(static_cast<std::size_t>(num_classes), 0), total(static_cast<std::size_t>(num_classes), 0);
  for (std::size_t i = 0; i < l.size(); ++i) {
    if (l[i] < 0 || l[i] >= num_classes)
      throw std::runtime_error("per_class_accuracy: label " + std::to_string(l[i]) + " is not in 0.." +
                               std::to_string(num_classes - 1));
    ++total[static_cast<std::size_t>(l[i])];
    hit[static_cast<std::size_t>(l[i])] += p[i] == l[i];
  }
  std::vector<double> out(static_cast<std::size_t>(num_classes), -1.0);
  for (std::size_t c = 0; c < out.size(); ++c)
    if (total[c] > 0) out[c] = static_cast<double>(hit[c]) / static_cast<double>(total[c]);
  return out;
}

// ---- files ----

void save_classifier(const Classifier& model, const std::string& path, const std::map<std::string, std::string>& metadata) {
  flame::io::Metadata md(metadata.begin(), metadata.end());
  md["format"] = kFormat;
  md["architecture"] = model.arch().to_string();
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  nn::save_state_dict(model, path, md);
}

std::shared_ptr<Classifier> load_classifier(const std::string& path, Device device) {
  if (!std::filesystem::is_regular_file(path))
    throw std::runtime_error("classifier file " + path + " does not exist (train one with train_classifier)");
  std::shared_ptr<Classifier> model;
  try {
    const auto md = flame::io::load_safetensors_metadata(path);
    const auto fmt = md.find("format");
    const auto arch = md.find("architecture");
    if (fmt == md.end() || fmt->second != kFormat || arch == md.end())
      throw std::runtime_error("not a classifier file (its metadata has no format '" + std::string(kFormat) +
                               "' and architecture)");
    model = std::make_shared<Classifier>(ClassifierArch::parse(arch->second));
    nn::load_state_dict(*model, path, /*strict=*/true);
  } catch (const std::exception& e) {
    throw std::runtime_error("classifier " + path + ": " + e.what());
  }
  model->to(device);
  model->eval();
  return model;
}

double grid_class_fraction(const std::string& classifier_path, const Tensor& images, const Tensor& labels, Device device) {
  auto model = load_classifier(classifier_path, device);
  return conditional_accuracy(*model, images, labels);
}

}  // namespace flame_diffusion
