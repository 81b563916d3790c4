// Training checkpoints: resume equality (a run checkpointed half-way and resumed in fresh objects
// reproduces the uninterrupted run's losses bit for bit), file layout, strictness, all-or-nothing
// loads, damaged files, rotation.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "flame/checkpoint.h"
#include "flame/io/safetensors.h"
#include "flame/nn.h"
#include "flame/optim/scheduler.h"
#include "sched_test_util.h"
#include "test_util.h"

namespace flame::test {
namespace {

struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = ::testing::TempDir() + "flame_ckpt_XXXXXX";
    char* p = ::mkdtemp(tmpl.data());
    if (p == nullptr) throw std::runtime_error("mkdtemp failed");
    path = p;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

// Three Linear layers with dropout between them: the RNG state matters for the next losses.
struct Net : nn::Module {
  std::shared_ptr<nn::Linear> l1, l2, l3;
  std::shared_ptr<nn::Dropout> drop;
  explicit Net(Device dev) {
    l1 = register_module("l1", std::make_shared<nn::Linear>(12, 40, true, TensorOptions(dev)));
    l2 = register_module("l2", std::make_shared<nn::Linear>(40, 24, true, TensorOptions(dev)));
    l3 = register_module("l3", std::make_shared<nn::Linear>(24, 5, true, TensorOptions(dev)));
    drop = register_module("drop", std::make_shared<nn::Dropout>(0.3));
  }
  std::string name() const override { return "Net"; }
  Tensor forward(const Tensor& x) override {
    Tensor h = drop->forward(l1->forward(x).gelu());
    h = drop->forward(l2->forward(h).tanh());
    return l3->forward(h);
  }
};

// Everything one training run holds, built fresh (as a new process would).
struct TrainRun {
  Device dev;
  std::shared_ptr<Net> net;
  std::unique_ptr<TestSGD> opt;
  optim::SchedulerPtr sched;
  Generator data_gen{777};
  Checkpoint ckpt;

  TrainRun(Device d, uint64_t init_seed, int64_t total) : dev(d) {
    manual_seed(init_seed);
    net = std::make_shared<Net>(dev);
    std::vector<optim::ParamGroup> groups(2);
    groups[0].params = {net->l1->weight(), net->l1->bias(), net->l2->weight()};
    groups[1].params = {net->l2->bias(), net->l3->weight(), net->l3->bias()};
    groups[0].lr = 0.05;
    groups[1].lr = 0.02;
    groups[0].momentum = groups[1].momentum = 0.9;
    opt = std::make_unique<TestSGD>(groups);
    sched = optim::warmup_cosine(*opt, 3, total, 1e-4, 0.1);
    ckpt.add("model", *net).add("optimizer", *opt).add("scheduler", *sched).add_generator("data", data_gen);
  }

  float train_step() {
    Tensor x = Tensor::randn({16, 12}, 0.0, 1.0, {DType::f32, dev}, &data_gen);
    Tensor y = Tensor::randn({16, 5}, 0.0, 1.0, {DType::f32, dev}, &data_gen);
    Tensor loss = mse_loss(net->forward(x), y);
    Gradients g = loss.backward();
    opt->step(g);
    sched->step();
    ++ckpt.progress().step;
    ckpt.progress().counters["samples"] += 16;
    return loss.item<float>();
  }
};

TEST(CheckpointTest, ResumeReproducesLossesBitExactly) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  TempDir dir;
  const int64_t N = 24;
  std::vector<float> straight;
  std::vector<float> straight_params;
  {
    TrainRun a(dev, 1234, N);
    for (int64_t i = 0; i < N; ++i) straight.push_back(a.train_step());
    for (const Tensor& p : a.net->parameters()) {
      for (float v : p.to_vec<float>()) straight_params.push_back(v);
    }
  }
  std::vector<float> resumed(straight.begin(), straight.begin() + N / 2);
  {
    TrainRun b(dev, 1234, N);
    for (int64_t i = 0; i < N / 2; ++i) ASSERT_EQ(b.train_step(), straight[static_cast<std::size_t>(i)]);
    b.ckpt.set_metadata("run", "resume-test");
    b.ckpt.save(dir / "half.safetensors");
  }
  // Disturb every generator a fresh process would not share, then resume into new objects built
  // from another seed: only the checkpoint can make the continuation equal.
  manual_seed(99);
  (void)Tensor::randn({1000}, 0.0, 1.0, {DType::f32, dev});
  {
    TrainRun c(dev, 4321, N);
    c.data_gen.manual_seed(5);
    const CheckpointInfo info = c.ckpt.load(dir / "half.safetensors");
    EXPECT_EQ(info.step, N / 2);
    EXPECT_EQ(c.ckpt.progress().step, N / 2);
    EXPECT_EQ(c.ckpt.progress().counters.at("samples"), 16 * N / 2);
    EXPECT_EQ(c.ckpt.metadata().at("run"), "resume-test");
    EXPECT_EQ(c.sched->last_epoch(), N / 2);
    for (int64_t i = N / 2; i < N; ++i) resumed.push_back(c.train_step());
    std::vector<float> params;
    for (const Tensor& p : c.net->parameters()) {
      for (float v : p.to_vec<float>()) params.push_back(v);
    }
    EXPECT_EQ(params, straight_params) << "final parameters differ after resume on " << dev.str();
  }
  for (std::size_t i = 0; i < straight.size(); ++i) {
    EXPECT_EQ(resumed[i], straight[i]) << "step " << i << " on " << dev.str();
  }
  {  // The check has teeth: one draw more from the default generator (dropout) changes the loss.
    TrainRun d(dev, 4321, N);
    d.ckpt.load(dir / "half.safetensors");
    (void)Tensor::rand({1}, {DType::f32, dev});
    EXPECT_NE(d.train_step(), straight[N / 2]);
  }
}

TEST(CheckpointTest, FileLayoutAndInfo) {
  TempDir dir;
  TrainRun r(Device::cpu(), 7, 10);
  for (int i = 0; i < 3; ++i) (void)r.train_step();
  r.ckpt.set_metadata("note", "layout");
  const std::string path = dir / "c.safetensors";
  r.ckpt.save(path);
  io::SafetensorsFile f(path);
  for (const char* key : {"model.l1.weight", "model.l3.bias", "optimizer.state.0.momentum_buffer",
                          "optimizer.param_groups.1.lr", "scheduler.kind", "scheduler.last_epoch",
                          "scheduler.schedulers.1.base_lrs", "rng.default.seed", "rng.default.offset",
                          "rng.data.offset", "progress.step", "progress.samples"}) {
    EXPECT_TRUE(f.contains(key)) << key;
  }
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.load("progress.step").item<int64_t>(), 3);
  EXPECT_EQ(f.load("scheduler.last_epoch").dtype(), DType::i64);
  EXPECT_EQ(static_cast<uint64_t>(f.load("rng.data.offset").item<int64_t>()), r.data_gen.offset());
  const CheckpointInfo info = read_checkpoint_info(path);
  EXPECT_EQ(info.format_version, 1);
  EXPECT_EQ(info.step, 3);
  EXPECT_EQ(info.components, (std::vector<std::string>{"model", "optimizer", "scheduler", "rng", "progress"}));
  EXPECT_EQ(info.metadata.at("note"), "layout");
  // The model part is an ordinary state dict: it loads into a module directly.
  Net other(Device::cpu());
  StateDict model;
  for (const std::string& n : f.names()) {
    if (n.rfind("model.", 0) == 0) model.insert(n.substr(6), f.load(n));
  }
  EXPECT_TRUE(other.load_state_dict(model).ok());
  // No temporary is left beside it.
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

// A Stateful holding one tensor; `refuse` makes its load fail after validation would have passed.
struct Box : Stateful {
  Tensor value = Tensor::randn({5}, 0.0, 1.0, DType::f64);
  bool refuse = false;
  StateDict state_dict() const override { return StateDict{{"value", value.clone()}}; }
  void load_state_dict(const StateDict& sd) override {
    FLAME_CHECK(!refuse, "Box::load_state_dict", "refusing on purpose");
    const Tensor& v = sd.at("value");
    FLAME_CHECK(v.sizes() == value.sizes(), "Box::load_state_dict", "key 'value' has shape ", v.sizes());
    value = v.clone();
  }
};

TEST(CheckpointTest, StrictComponentsAndNothingChangedOnError) {
  TempDir dir;
  const std::string path = dir / "c.safetensors";
  Net net(Device::cpu());
  Box a, b;
  {
    Checkpoint ck;
    ck.add("model", net).add("a", a).add("b", b);
    ck.progress().step = 41;
    ck.save(path);
  }
  const std::vector<float> w0 = net.l1->weight().to_vec<float>();
  Net net2(Device::cpu());
  Box a2, b2, c2;
  const std::vector<double> a2_before = a2.value.to_vec<double>();
  const std::vector<float> net2_before = net2.l1->weight().to_vec<float>();
  auto unchanged = [&] {
    EXPECT_EQ(a2.value.to_vec<double>(), a2_before);
    EXPECT_EQ(net2.l1->weight().to_vec<float>(), net2_before);
  };
  {  // a component registered but absent from the file
    Checkpoint ck;
    ck.add("model", net2).add("a", a2).add("b", b2).add("c", c2);
    try {
      ck.load(path);
      ADD_FAILURE() << "strict load accepted a missing component";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("missing from the file: c"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
    EXPECT_EQ(ck.progress().step, 0);
    unchanged();
    CheckpointLoadOptions lax;
    lax.strict = false;
    const CheckpointInfo info = ck.load(path, lax);
    EXPECT_EQ(info.missing_components, std::vector<std::string>{"c"});
    EXPECT_EQ(ck.progress().step, 41);
    EXPECT_EQ(a2.value.to_vec<double>(), a.value.to_vec<double>());
    EXPECT_EQ(net2.l1->weight().to_vec<float>(), w0);
  }
  Net net3(Device::cpu());
  Box a3;
  const std::vector<double> a3_before = a3.value.to_vec<double>();
  {  // a component in the file but not registered
    Checkpoint ck;
    ck.add("model", net3).add("a", a3);
    EXPECT_THROW(ck.load(path), Error);
    EXPECT_EQ(a3.value.to_vec<double>(), a3_before);
    CheckpointLoadOptions lax;
    lax.strict = false;
    const CheckpointInfo info = ck.load(path, lax);
    EXPECT_EQ(info.unexpected_components, std::vector<std::string>{"b"});
  }
  {  // a module that does not match: named key, nothing changed (the Statefuls neither)
    struct Wide : nn::Module {
      std::shared_ptr<nn::Linear> l1;
      Wide() { l1 = register_module("l1", std::make_shared<nn::Linear>(12, 41)); }
    } wide;
    Box a4, b4;
    const std::vector<double> a4_before = a4.value.to_vec<double>();
    Checkpoint ck;
    ck.add("model", wide).add("a", a4).add("b", b4);
    try {
      ck.load(path);
      ADD_FAILURE() << "loaded into a mismatched module";
    } catch (const Error& e) {
      const std::string w = e.what();
      EXPECT_NE(w.find("model.l1.weight"), std::string::npos) << w;
      EXPECT_NE(w.find("unexpected key 'model.l2.weight'"), std::string::npos) << w;
    }
    EXPECT_EQ(a4.value.to_vec<double>(), a4_before);
    EXPECT_EQ(ck.progress().step, 0);
    // Non-strict module: loads what matches and reports the rest.
    Checkpoint lax_ck;
    Box a5, b5;
    lax_ck.add("model", wide, /*strict=*/false).add("a", a5).add("b", b5);
    const CheckpointInfo info = lax_ck.load(path);
    ASSERT_TRUE(info.module_reports.count("model"));
    EXPECT_FALSE(info.module_reports.at("model").ok());
  }
  {  // a Stateful that refuses after an earlier one loaded: the earlier one is put back
    Net net6(Device::cpu());
    Box a6, b6;
    b6.refuse = true;
    const std::vector<double> a6_before = a6.value.to_vec<double>();
    const std::vector<float> net6_before = net6.l1->weight().to_vec<float>();
    const uint64_t offset_before = default_generator().offset();
    Checkpoint ck;
    ck.add("model", net6).add("a", a6).add("b", b6);
    try {
      ck.load(path);
      ADD_FAILURE() << "a refusing component was not reported";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("component 'b' refused"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("refusing on purpose"), std::string::npos) << e.what();
    }
    EXPECT_EQ(a6.value.to_vec<double>(), a6_before);
    EXPECT_EQ(net6.l1->weight().to_vec<float>(), net6_before);
    EXPECT_EQ(default_generator().offset(), offset_before);
    EXPECT_EQ(ck.progress().step, 0);
  }
}

TEST(CheckpointTest, CudaStateMovesAcrossDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  TempDir dir;
  const std::string path = dir / "c.safetensors";
  manual_seed(3);
  Net gpu_net(Device::cuda());
  Box box;
  box.value = Tensor::randn({5}, 0.0, 1.0, {DType::f64, Device::cuda()});
  {
    Checkpoint ck;
    ck.add("model", gpu_net).add("box", box);
    ck.save(path);
  }
  // Into a CPU model: the same values; the Stateful gets CPU tensors by default.
  Net cpu_net(Device::cpu());
  Box cpu_box;
  Checkpoint ck;
  ck.add("model", cpu_net).add("box", cpu_box);
  ck.load(path);
  for (std::size_t i = 0; i < gpu_net.parameters().size(); ++i) {
    EXPECT_EQ(cpu_net.parameters()[i].to_vec<float>(), gpu_net.parameters()[i].to_vec<float>());
  }
  EXPECT_TRUE(cpu_box.value.device().is_cpu());
  EXPECT_EQ(cpu_box.value.to_vec<double>(), box.value.to_vec<double>());
  // map_location hands them over on the GPU.
  CheckpointLoadOptions o;
  o.map_location = Device::cuda();
  ck.load(path, o);
  EXPECT_TRUE(cpu_box.value.device().is_cuda());
  EXPECT_EQ(cpu_box.value.to_vec<double>(), box.value.to_vec<double>());
}

TEST(CheckpointTest, RegistrationErrors) {
  Checkpoint ck;
  Box a;
  Generator g;
  ck.add("a", a);
  EXPECT_THROW(ck.add("a", a), Error);
  EXPECT_THROW(ck.add("rng", a), Error);
  EXPECT_THROW(ck.add("progress", a), Error);
  EXPECT_THROW(ck.add("x.y", a), Error);
  EXPECT_THROW(ck.add("", a), Error);
  EXPECT_THROW(ck.add_generator("default", g), Error);
  ck.add_generator("g", g);
  EXPECT_THROW(ck.add_generator("g", g), Error);
}

std::vector<char> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), {});
}
void write_all(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

TEST(CheckpointTest, DamagedFilesGiveClearErrors) {
  TempDir dir;
  const std::string path = dir / "c.safetensors";
  Net net(Device::cpu());
  Box a;
  Checkpoint ck;
  ck.add("model", net).add("a", a);
  ck.save(path);
  const std::vector<char> good = read_all(path);
  auto expect_error = [&](const std::string& file, const std::vector<std::string>& needles) {
    Net n2(Device::cpu());
    Box a2;
    const std::vector<double> before = a2.value.to_vec<double>();
    Checkpoint c2;
    c2.add("model", n2).add("a", a2);
    try {
      c2.load(file);
      ADD_FAILURE() << "loaded a damaged file";
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
    EXPECT_EQ(a2.value.to_vec<double>(), before);
  };
  {  // one flipped bit inside a tensor: its checksum names it
    const io::TensorInfo info = io::SafetensorsFile(path).info("model.l2.weight");
    std::vector<char> bad = good;
    bad[info.offset + info.nbytes / 2] ^= 0x10;
    write_all(dir / "flip.safetensors", bad);
    expect_error(dir / "flip.safetensors", {"model.l2.weight", "checksum", dir / "flip.safetensors"});
  }
  for (std::size_t cut : {std::size_t{1}, std::size_t{100}, good.size() / 2, good.size() - 9}) {  // truncated
    std::vector<char> bad(good.begin(), good.end() - static_cast<std::ptrdiff_t>(cut));
    write_all(dir / "cut.safetensors", bad);
    expect_error(dir / "cut.safetensors", {"cannot read checkpoint", dir / "cut.safetensors"});
  }
  write_all(dir / "empty.safetensors", {});
  expect_error(dir / "empty.safetensors", {"cannot read checkpoint"});
  expect_error(dir / "absent.safetensors", {"cannot read checkpoint", "absent.safetensors"});
  {  // a safetensors file that is not a checkpoint
    io::save_safetensors(dir / "plain.safetensors", net.state_dict());
    expect_error(dir / "plain.safetensors", {"not a FLAME checkpoint"});
  }
  {  // a newer format version
    io::SafetensorsFile f(path);
    io::Metadata meta = f.metadata();
    std::string& j = meta.at("flame.checkpoint");
    const std::size_t at = j.find("\"format_version\":1");
    ASSERT_NE(at, std::string::npos);
    j.replace(at, 18, "\"format_version\":99");
    io::save_safetensors(dir / "future.safetensors", f.load_all(), meta);
    expect_error(dir / "future.safetensors", {"format_version 99"});
  }
  // And the good file still loads.
  Net n3(Device::cpu());
  Box a3;
  Checkpoint c3;
  c3.add("model", n3).add("a", a3);
  c3.load(path);
  EXPECT_EQ(a3.value.to_vec<double>(), a.value.to_vec<double>());
}

TEST(CheckpointTest, FailedSaveLeavesPreviousFile) {
  TempDir dir;
  const std::string path = dir / "c.safetensors";
  Box a;
  Checkpoint ck;
  ck.add("a", a);
  ck.progress().step = 1;
  ck.save(path);
  struct Broken : Stateful {
    StateDict state_dict() const override { return StateDict{{"x", Tensor()}}; }
    void load_state_dict(const StateDict&) override {}
  } broken;
  ck.add("broken", broken);
  ck.progress().step = 2;
  try {
    ck.save(path);
    ADD_FAILURE() << "saved a component with an undefined tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("component 'broken'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_EQ(read_checkpoint_info(path).step, 1);
  Checkpoint fine;
  fine.add("a", a);
  try {
    fine.save(dir / "no/such/dir/c.safetensors");
    ADD_FAILURE() << "saved into a directory that does not exist";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("saving '" + (dir / "no/such/dir/c.safetensors") + "' failed"),
              std::string::npos)
        << e.what();
  }
  int files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
}

TEST(CheckpointTest, RotationLatestAndStaleTemporaries) {
  TempDir dir;
  Box a;
  Checkpoint ck;
  ck.add("a", a);
  std::vector<std::string> written;
  for (int64_t s : {5, 10, 15, 20}) {
    ck.progress().step = s;
    written.push_back(ck.save_rotating(dir.path, 2));
  }
  EXPECT_EQ(written.back(), checkpoint_path(dir.path, 20));
  EXPECT_FALSE(std::filesystem::exists(written[0]));
  EXPECT_FALSE(std::filesystem::exists(written[1]));
  EXPECT_TRUE(std::filesystem::exists(written[2]));
  EXPECT_EQ(latest_checkpoint(dir.path), written[3]);
  // A newer file that is not a readable checkpoint is skipped.
  write_all(checkpoint_path(dir.path, 25), {'n', 'o', 'p', 'e'});
  EXPECT_EQ(latest_checkpoint(dir.path), written[3]);
  EXPECT_EQ(latest_checkpoint(dir / "missing"), std::nullopt);
  EXPECT_EQ(latest_checkpoint(dir.path, "other"), std::nullopt);
  // Temporaries: a dead process's is removed, a live one's is kept.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  ::waitpid(child, &status, 0);
  const std::string dead = dir / (".ckpt-0000000030.safetensors.flame-tmp." + std::to_string(child) + ".0");
  const std::string live = dir / (".ckpt-0000000030.safetensors.flame-tmp." + std::to_string(::getppid()) + ".0");
  write_all(dead, {'x'});
  write_all(live, {'x'});
  EXPECT_EQ(remove_stale_temporaries(dir.path), std::vector<std::string>{dead});
  EXPECT_TRUE(std::filesystem::exists(live));
}

}  // namespace
}  // namespace flame::test
