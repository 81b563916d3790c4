// train_classifier: trains the Fashion-MNIST classifier that judges class-conditional samples
// (flame-diffusion reports the fraction of a sample grid recognised as its conditioning class).
//   train_classifier --epochs 10 --device cuda --out classifier.safetensors
//   train_classifier --epochs 1 --train-limit 2048 --test-limit 1000 --device cpu --out /tmp/clf.safetensors
// Prints one line per epoch (loss, train and test accuracy, time), then the test accuracy and the
// file written.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "classifier.h"

using namespace flame_diffusion;

int main(int argc, char** argv) {
  CLI::App app{"train_classifier: a ResNet-style Fashion-MNIST classifier, saved as safetensors"};
  ClassifierTrainOptions o;
  o.out = "classifier.safetensors";
  std::string widths = "64,128,256";
  double min_accuracy = 0;
  app.add_option("--epochs", o.epochs, "training epochs")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "images per step")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "peak learning rate of the one-cycle schedule")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--optimizer", o.optimizer, "sgd (Nesterov momentum) or adamw")->capture_default_str();
  app.add_option("--weight-decay", o.weight_decay, "weight decay of the conv and linear weights")->capture_default_str();
  app.add_option("--label-smoothing", o.label_smoothing, "cross-entropy label smoothing")->capture_default_str()->check(CLI::Range(0.0, 0.5));
  app.add_option("--augment", o.augment, "random flips and 2-pixel shifts")->capture_default_str();
  app.add_option("--amp", o.amp, "autocast: auto (bf16 on CUDA), bf16, off")->capture_default_str();
  app.add_option("--widths", widths, "channels of the ResNet stages, e.g. 64,128,256")->capture_default_str();
  app.add_option("--blocks", o.arch.blocks, "BasicBlocks per stage")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--device", o.device, "auto, cpu, cuda or cuda:N")->capture_default_str();
  app.add_option("--data", o.data_dir, "Fashion-MNIST directory (default: the Debian package's)");
  app.add_option("--seed", o.seed, "seed of the weights, data order and augmentation")->capture_default_str();
  app.add_option("--train-limit", o.train_limit, "use only the first N training images (0: all)")->capture_default_str();
  app.add_option("--test-limit", o.test_limit, "use only the first N test images (0: all)")->capture_default_str();
  app.add_option("--min-accuracy", min_accuracy, "exit with status 2 when the final test accuracy is below this (0..1)")
      ->capture_default_str();
  app.add_option("--out", o.out, "safetensors file to write")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    o.arch.widths = ClassifierArch::parse("resnet widths=" + widths).widths;
    const ClassifierTrainResult r = train_classifier(o);
    std::printf("test accuracy %.2f%% after %lld epochs (%.1f s)\nclassifier written to %s\n", 100.0 * r.test_accuracy,
                static_cast<long long>(o.epochs), r.seconds, r.path.c_str());
    if (min_accuracy > 0 && r.test_accuracy < min_accuracy) {
      std::fprintf(stderr, "train_classifier: test accuracy %.4f is below --min-accuracy %.4f\n", r.test_accuracy,
                   min_accuracy);
      return 2;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\ntrain_classifier: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
