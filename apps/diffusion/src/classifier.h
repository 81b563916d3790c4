#pragma once
// A small ResNet-style CNN for Fashion-MNIST: the judge of class-conditional samples. A trained
// classifier tells what fraction of a sample grid is recognised as the class each sample was
// conditioned on (issue #11, "Done when": >= 90% of 1000 samples for dit-s).
//
//   ClassifierTrainOptions o;  o.epochs = 10;  o.device = "cuda";  o.out = "classifier.safetensors";
//   ClassifierTrainResult r = train_classifier(o);       // r.test_accuracy >= 0.93 on the GPU
//   double f = grid_class_fraction("classifier.safetensors", samples, labels, Device::cuda(0));
//
// Architecture (torchvision's ResNet names, so the state dict reads like resnet18's):
//   conv1 3x3 (1 -> w0) + bn1 + ReLU at 28x28,
//   layer1..layerK: `blocks` BasicBlocks each [conv3x3-BN-ReLU-conv3x3-BN + skip, ReLU]; the first
//   block of every stage after the first halves the resolution (stride 2; 28 -> 14 -> 7) and its
//   skip is a 1x1 conv + BN (downsample),
//   global average pool, fc Linear(w_last, 10).
// The widths and block count are saved in the file's metadata, so load_classifier rebuilds the
// network a file was trained with.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/nn.h>

#include "data.h"

namespace flame_diffusion {

struct ClassifierArch {
  std::vector<int64_t> widths{64, 128, 256};  // channels of each stage (the stem has widths[0])
  int64_t blocks = 2;                         // BasicBlocks per stage
  int64_t num_classes = 10;
  int64_t in_channels = 1;
  // "resnet widths=64,128,256 blocks=2 classes=10 in=1" (the file metadata "architecture").
  std::string to_string() const;
  // The inverse of to_string; errors name the text.
  static ClassifierArch parse(const std::string& text);
};

// conv3x3-BN-ReLU-conv3x3-BN plus the (possibly projected) input, then ReLU.
class BasicBlock : public flame::nn::Module {
 public:
  BasicBlock(int64_t in_channels, int64_t out_channels, int64_t stride);
  std::string name() const override { return "BasicBlock"; }
  flame::Tensor forward(const flame::Tensor& x) override;

 private:
  std::shared_ptr<flame::nn::Conv2d> conv1_, conv2_;
  std::shared_ptr<flame::nn::BatchNorm2d> bn1_, bn2_;
  std::shared_ptr<flame::nn::Sequential> downsample_;  // null when the shapes already agree
};

class Classifier : public flame::nn::Module {
 public:
  explicit Classifier(ClassifierArch arch = {});
  std::string name() const override { return "Classifier"; }
  std::string extra_repr() const override { return arch_.to_string(); }
  // images [N, in_channels, H, W] (in [-1, 1] for Fashion-MNIST) -> logits [N, num_classes].
  flame::Tensor forward(const flame::Tensor& x) override;
  const ClassifierArch& arch() const { return arch_; }

 private:
  ClassifierArch arch_;
  std::shared_ptr<flame::nn::Conv2d> conv1_;
  std::shared_ptr<flame::nn::BatchNorm2d> bn1_;
  std::vector<std::shared_ptr<flame::nn::Sequential>> layers_;
  std::shared_ptr<flame::nn::Linear> fc_;
};

// ---- training ----

struct ClassifierTrainOptions {
  int64_t epochs = 10;
  int64_t batch = 256;
  std::string optimizer = "sgd";  // sgd (Nesterov momentum) or adamw
  double lr = 0.1;                // the peak of the one-cycle schedule
  double weight_decay = 5e-4;
  double momentum = 0.9;          // SGD's (one-cycle moves it between 0.85 and this)
  double label_smoothing = 0.0;
  bool augment = true;             // random horizontal flips and random 2-pixel shifts (crops of the padded image)
  std::string amp = "auto";        // auto (bf16 on CUDA), bf16, off
  std::string device = "auto";     // auto, cpu, cuda, cuda:N
  std::string data_dir;            // empty: find_data_dir's places
  uint64_t seed = 0;
  int64_t train_limit = 0;         // > 0: only the first N training images (quick CPU runs)
  int64_t test_limit = 0;          // > 0: only the first N test images
  std::string out;                 // non-empty: the safetensors file written at the end
  ClassifierArch arch;
  bool verbose = true;             // one line per epoch on stderr
};

struct ClassifierEpoch {
  int64_t epoch = 0;         // 1-based
  double loss = 0;           // mean training loss of the epoch
  double train_accuracy = 0; // on the (augmented) training batches, in training mode
  double test_accuracy = -1; // -1: no test set
  double seconds = 0;        // wall time of the epoch (training and evaluation)
};

struct ClassifierTrainResult {
  std::shared_ptr<Classifier> model;  // in eval mode, on the training device
  std::vector<ClassifierEpoch> epochs;
  double test_accuracy = -1;
  double seconds = 0;
  std::string path;  // the file written (empty when options.out is empty)
};

// Loads Fashion-MNIST (options.data_dir), trains a Classifier and evaluates it after each epoch;
// saves it to options.out when set.
ClassifierTrainResult train_classifier(const ClassifierTrainOptions& options);
// The loop itself, on given data (tests use synthetic sets): trains `model` in place on `device`.
// `test` may be null. options.data_dir, out and device are not used.
ClassifierTrainResult train_classifier_on(std::shared_ptr<Classifier> model, std::shared_ptr<const Dataset> train,
                                          std::shared_ptr<const Dataset> test, const ClassifierTrainOptions& options,
                                          flame::Device device);

// ---- inference ----

// Accuracy of `model` (switched to eval mode) on a whole data set, on the model's device.
double evaluate(Classifier& model, std::shared_ptr<const Dataset> data, int64_t batch = 1000);
double evaluate(Classifier& model, const Dataset& data, int64_t batch = 1000);
// Predicted labels (i64 [N], on the images' device) for images f32 [N, C, H, W] in [-1, 1] (any
// device: moved to the model's), in chunks of `batch`, in eval mode without gradients.
flame::Tensor classify(Classifier& model, const flame::Tensor& images, int64_t batch = 1000);
// Fraction of predictions equal to labels (both [N], integer; any devices). Errors on a size
// mismatch or N = 0.
double conditional_accuracy(const flame::Tensor& predictions, const flame::Tensor& labels);
// Fraction of `images` that `classifier` assigns to the class in `labels` (i64 [N]).
double conditional_accuracy(Classifier& classifier, const flame::Tensor& images, const flame::Tensor& labels);
// Per class c: fraction of the images labelled c classified as c (-1 where no image has label c).
std::vector<double> per_class_accuracy(const flame::Tensor& predictions, const flame::Tensor& labels,
                                       int64_t num_classes = 10);

// ---- files ----

// safetensors with metadata {"format": "flame-diffusion-classifier", "architecture": arch string}
// plus `metadata`.
void save_classifier(const Classifier& model, const std::string& path,
                     const std::map<std::string, std::string>& metadata = {});
// Rebuilds the architecture named in the file's metadata, loads the weights (strict), moves the
// model to `device` and sets eval mode. Errors name the file.
std::shared_ptr<Classifier> load_classifier(const std::string& path, flame::Device device = flame::Device::cpu());

// The trainer's hook: loads the classifier at `classifier_path` onto `device` and returns the
// fraction of `images` (f32 [N, 1, 28, 28] in [-1, 1], e.g. a sample grid) classified as their
// conditioning class `labels` (i64 [N]).
double grid_class_fraction(const std::string& classifier_path, const flame::Tensor& images,
                           const flame::Tensor& labels, flame::Device device);

}  // namespace flame_diffusion
