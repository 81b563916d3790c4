// The Fashion-MNIST classifier (classifier.h): shapes, the architecture string, safetensors round
// trips, learning on a fixed batch and on a synthetic data set, and the sample-grid metrics.
// FLAME_TEST_DEVICE=cuda runs them on GPU 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

#include <flame/flame.h>
#include <flame/io/safetensors.h>
#include <flame/nn.h>

#include "classifier.h"
#include "model_test_util.h"

using namespace flame_diffusion;
using flame::Device;
using flame::DType;
using flame::Tensor;

namespace {

ClassifierArch tiny_arch() {
  ClassifierArch a;
  a.widths = {8, 16};
  a.blocks = 1;
  return a;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("fd_clf_" + std::to_string(::getpid()) + "_" + name)).string();
}

// n images whose class (0..3) is their mean brightness level: background noise plus a random
// rectangle, all scaled by the class, so the label is a function of the image but not of any one
// pixel.
Dataset brightness_dataset(int64_t n, uint64_t seed) {
  Dataset d;
  d.n = n;
  d.rows = d.cols = 28;
  d.images.resize(static_cast<std::size_t>(n * 28 * 28));
  d.labels.resize(static_cast<std::size_t>(n));
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  auto next = [&s]() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  };
  for (int64_t i = 0; i < n; ++i) {
    const int label = static_cast<int>(next() % 4);
    d.labels[static_cast<std::size_t>(i)] = static_cast<uint8_t>(label);
    const int64_t r0 = static_cast<int64_t>(next() % 14), c0 = static_cast<int64_t>(next() % 14);
    const int64_t r1 = r0 + 6 + static_cast<int64_t>(next() % 8), c1 = c0 + 6 + static_cast<int64_t>(next() % 8);
    for (int64_t r = 0; r < 28; ++r) {
      for (int64_t c = 0; c < 28; ++c) {
        const bool inside = r >= r0 && r < r1 && c >= c0 && c < c1;
        const int base = inside ? 40 + 60 * label : 10 * label;
        const int noise = static_cast<int>(next() % 21) - 10;
        d.images[static_cast<std::size_t>(i * 784 + r * 28 + c)] = static_cast<uint8_t>(std::clamp(base + noise, 0, 255));
      }
    }
  }
  return d;
}

}  // namespace

TEST(ClassifierModel, ForwardShapes) {
  FD_SKIP_IF_NO_DEVICE();
  const Device dev = fd_test::test_device();
  flame::manual_seed(3);
  flame::Generator gen(11);
  {
    Classifier m;  // the default: 64/128/256, 2 blocks per stage
    m.to(dev);
    const Tensor y = m.forward(fd_test::rand_images(2, 1, 28, dev, &gen));
    EXPECT_EQ(y.sizes(), (flame::Shape{2, 10}));
    EXPECT_EQ(y.dtype(), DType::f32);
    // torchvision's names: the second stage's first block has a projection.
    EXPECT_NO_THROW(m.submodule("layer2.0.downsample"));
    EXPECT_THROW(m.submodule("layer1.0.downsample"), std::exception);
    EXPECT_TRUE(std::isfinite(y.abs().sum().item<double>()));
  }
  Classifier t(tiny_arch());
  t.to(dev);
  t.eval();
  const Tensor y = t.forward(fd_test::rand_images(5, 1, 28, dev, &gen));
  EXPECT_EQ(y.sizes(), (flame::Shape{5, 10}));
  // Other image sizes go through the global pool.
  EXPECT_EQ(t.forward(fd_test::rand_images(3, 1, 16, dev, &gen)).sizes(), (flame::Shape{3, 10}));
  EXPECT_THROW(t.forward(fd_test::rand_images(2, 3, 28, dev, &gen)), std::runtime_error);
  EXPECT_THROW(t.forward(Tensor::zeros({2, 28, 28}, {DType::f32, dev})), std::runtime_error);
}

TEST(ClassifierModel, ArchitectureString) {
  ClassifierArch a;
  a.widths = {16, 32, 48};
  a.blocks = 3;
  const ClassifierArch b = ClassifierArch::parse(a.to_string());
  EXPECT_EQ(b.widths, a.widths);
  EXPECT_EQ(b.blocks, 3);
  EXPECT_EQ(b.num_classes, 10);
  EXPECT_EQ(b.in_channels, 1);
  EXPECT_THROW(ClassifierArch::parse("vgg widths=1"), std::runtime_error);
  EXPECT_THROW(ClassifierArch::parse("resnet blocks=2"), std::runtime_error);
  EXPECT_THROW(ClassifierArch::parse("resnet widths=8,x blocks=1"), std::runtime_error);
  EXPECT_THROW(ClassifierArch::parse("resnet widths=8 depth=1"), std::runtime_error);
  EXPECT_THROW(ClassifierArch::parse("resnet widths=8 blocks=0"), std::runtime_error);
}

TEST(ClassifierFiles, SaveLoadRoundTrip) {
  FD_SKIP_IF_NO_DEVICE();
  const Device dev = fd_test::test_device();
  flame::manual_seed(5);
  flame::Generator gen(21);
  auto m = std::make_shared<Classifier>(tiny_arch());
  m->to(dev);
  fd_test::perturb(*m, 0.05, 7);  // BN scales and shifts away from 1 and 0
  // Training-mode forwards move the running statistics away from their initial values.
  m->train();
  {
    flame::NoGradGuard no_grad;
    for (int i = 0; i < 3; ++i) (void)m->forward(fd_test::rand_images(16, 1, 28, dev, &gen) * 0.5 + 0.2);
  }
  m->eval();
  const Tensor x = fd_test::rand_images(6, 1, 28, dev, &gen);
  const Tensor before = m->forward(x);
  const double tol = dev.is_cuda() ? 1e-5 * fd_test::max_abs(before) : 0.0;  // see below
  const std::string path = temp_path("roundtrip.safetensors");
  save_classifier(*m, path, {{"note", "test"}});
  const auto md = flame::io::load_safetensors_metadata(path);
  EXPECT_EQ(md.at("format"), "flame-diffusion-classifier");
  EXPECT_EQ(md.at("architecture"), tiny_arch().to_string());
  EXPECT_EQ(md.at("note"), "test");

  auto loaded = load_classifier(path, dev);
  EXPECT_FALSE(loaded->is_training());
  EXPECT_EQ(loaded->arch().widths, tiny_arch().widths);
  const Tensor after = loaded->forward(x);
  // Identical weights and statistics give identical logits; on CUDA a tiny tolerance in case cuDNN
  // picks another algorithm for the new tensors' alignment (FLAME's conv plans are keyed by it).
  EXPECT_LE(fd_test::max_abs_diff(before, after), tol);
  EXPECT_GT(fd_test::max_abs(before), 0.0);
  // A freshly initialised model of the same architecture gives other logits (the load is real).
  Classifier fresh(tiny_arch());
  fresh.to(dev);
  fresh.eval();
  EXPECT_GT(fd_test::max_abs_diff(before, fresh.forward(x)), 1e-4);

  // Errors name the file.
  try {
    (void)load_classifier(temp_path("missing.safetensors"), dev);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos) << e.what();
  }
  const std::string other = temp_path("other.safetensors");
  flame::io::save_safetensors(other, {{"w", Tensor::ones({2})}}, {{"format", "pt"}});
  try {
    (void)load_classifier(other, dev);
    ADD_FAILURE() << "no error for a file that is not a classifier";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("other.safetensors"), std::string::npos) << e.what();
  }
  // A classifier file whose tensors do not match its architecture string.
  const std::string wrong = temp_path("wrong.safetensors");
  Classifier small(tiny_arch());
  flame::io::Metadata bad_md{{"format", "flame-diffusion-classifier"}, {"architecture", "resnet widths=8,32 blocks=1"}};
  flame::nn::save_state_dict(small, wrong, bad_md);
  EXPECT_THROW(load_classifier(wrong, dev), std::runtime_error);
  std::filesystem::remove(path);
  std::filesystem::remove(other);
  std::filesystem::remove(wrong);
}

TEST(ClassifierTrain, SgdStepsLowerTheLossOnAFixedBatch) {
  FD_SKIP_IF_NO_DEVICE();
  const Device dev = fd_test::test_device();
  flame::manual_seed(9);
  flame::Generator gen(31);
  Classifier m(tiny_arch());
  m.to(dev);
  m.train();
  const Tensor x = fd_test::rand_images(32, 1, 28, dev, &gen);
  const Tensor y = fd_test::rand_labels(32, 10, dev, &gen);
  std::vector<double> losses;
  for (int step = 0; step < 10; ++step) {
    const Tensor loss = flame::cross_entropy(m.forward(x), y);
    losses.push_back(loss.item<double>());
    const flame::Gradients grads = loss.backward();
    fd_test::sgd_step(m, grads, 0.2);
  }
  const Tensor final_loss = flame::cross_entropy(m.forward(x), y);
  EXPECT_NEAR(losses.front(), std::log(10.0), 0.5);  // close to uniform at initialisation
  std::string trace;
  for (double l : losses) trace += std::to_string(l) + " ";
  // Random labels are memorised slowly: each step lowers the loss.
  for (std::size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]) << trace;
  EXPECT_LT(final_loss.item<double>(), losses.front() - 0.1) << trace;
}

TEST(ClassifierTrain, LearnsASyntheticTaskAndEvaluates) {
  FD_SKIP_IF_NO_DEVICE();
  const Device dev = fd_test::test_device();
  auto train = std::make_shared<const Dataset>(brightness_dataset(768, 1));
  auto test = std::make_shared<const Dataset>(brightness_dataset(200, 2));
  flame::manual_seed(13);
  auto model = std::make_shared<Classifier>(tiny_arch());
  ClassifierTrainOptions o;
  o.epochs = 5;
  o.batch = 32;
  o.lr = 0.1;
  o.verbose = false;
  o.seed = 4;
  // Before training: about chance (4 classes).
  model->to(dev);
  const double before = evaluate(*model, test);
  const ClassifierTrainResult r = train_classifier_on(model, train, test, o, dev);
  ASSERT_EQ(r.epochs.size(), 5u);
  EXPECT_GE(r.test_accuracy, 0.9) << "before training " << before;
  EXPECT_LT(r.epochs.back().loss, r.epochs.front().loss);
  EXPECT_GT(r.epochs.back().train_accuracy, 0.8);
  EXPECT_FALSE(model->is_training());
  // evaluate() agrees with the loop's figure and with classify() on the same images.
  // Exact on the CPU; on CUDA another batch size may pick another cuDNN algorithm, which can move a
  // near-tie (at most one sample in 100 allowed).
  const double tol = dev.is_cuda() ? 0.01 : 0.0;
  EXPECT_NEAR(evaluate(*model, *test), r.test_accuracy, tol);
  std::vector<float> pixels(test->images.size());
  for (std::size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<float>(test->images[i]) / 127.5f - 1.0f;
  const Tensor images = Tensor::from_vec(pixels, {test->n, 1, 28, 28}).to(dev);
  std::vector<int64_t> lab(test->labels.begin(), test->labels.end());
  const Tensor labels = Tensor::from_vec(lab, {test->n}).to(dev);
  EXPECT_NEAR(conditional_accuracy(*model, images, labels), r.test_accuracy, tol);
  // Chunked classification gives the whole-batch predictions.
  const Tensor whole = classify(*model, images);
  const Tensor chunked = classify(*model, images, 7);
  if (!dev.is_cuda()) {
    EXPECT_EQ(whole.to_vec<int64_t>(), chunked.to_vec<int64_t>());
  } else {
    EXPECT_NEAR(conditional_accuracy(whole, chunked), 1.0, tol);
  }
  EXPECT_EQ(whole.dtype(), DType::i64);
  EXPECT_EQ(whole.device(), dev);
  // The trainer's hook reads the model back from a file.
  const std::string path = temp_path("synthetic.safetensors");
  save_classifier(*model, path);
  EXPECT_NEAR(grid_class_fraction(path, images, labels, dev), conditional_accuracy(whole, labels), tol);
  // Bad options are errors.
  ClassifierTrainOptions bad = o;
  bad.optimizer = "rmsprop";
  EXPECT_THROW(train_classifier_on(model, train, test, bad, dev), std::runtime_error);
  bad = o;
  bad.batch = 10000;
  EXPECT_THROW(train_classifier_on(model, train, test, bad, dev), std::runtime_error);
  std::filesystem::remove(path);
}

TEST(ClassifierMetrics, ConditionalAccuracyOfHandMadePredictions) {
  FD_SKIP_IF_NO_DEVICE();
  const Device dev = fd_test::test_device();
  const Tensor preds = Tensor::from_vec(std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 3, 3}, {10}).to(dev);
  const Tensor labels = Tensor::from_vec(std::vector<int64_t>{0, 1, 2, 0, 0, 5, 6, 7, 3, 9}, {10});
  EXPECT_DOUBLE_EQ(conditional_accuracy(preds, labels), 0.7);
  const auto per = per_class_accuracy(preds, labels);
  ASSERT_EQ(per.size(), 10u);
  EXPECT_DOUBLE_EQ(per[0], 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(per[1], 1.0);
  EXPECT_DOUBLE_EQ(per[3], 1.0);
  EXPECT_DOUBLE_EQ(per[4], -1.0);  // no sample labelled 4
  EXPECT_DOUBLE_EQ(per[9], 0.0);
  EXPECT_DOUBLE_EQ(conditional_accuracy(labels, labels), 1.0);
  EXPECT_THROW(conditional_accuracy(preds, labels.narrow(0, 0, 9)), std::runtime_error);
  EXPECT_THROW(conditional_accuracy(Tensor::zeros({0}, DType::i64), Tensor::zeros({0}, DType::i64)), std::runtime_error);
  EXPECT_THROW(conditional_accuracy(preds.reshape({2, 5}), labels.reshape({2, 5})), std::runtime_error);
  Classifier m(tiny_arch());
  flame::Generator gen(3);
  EXPECT_THROW(conditional_accuracy(m, fd_test::rand_images(4, 1, 28, Device::cpu(), &gen), labels), std::runtime_error);
}
