// nn::Module and the containers: names, order, modes, freezing, conversion with identity kept,
// state dicts and their load reports; Tensor::set_data.
#include <algorithm>

#include "nn_test_util.h"

namespace flame::test {
namespace {

using namespace flame::nn;

std::vector<std::string> names_of(const std::vector<std::pair<std::string, Tensor>>& v) {
  std::vector<std::string> out;
  for (const auto& [n, t] : v) out.push_back(n);
  return out;
}

// A user module as docs/nn.md shows: children held as typed shared_ptr members.
struct Attention : Module {
  std::shared_ptr<Linear> qkv, proj;
  Attention(int64_t d, TensorOptions o) {
    qkv = register_module("qkv", std::make_shared<Linear>(d, 3 * d, true, o));
    proj = register_module("proj", std::make_shared<Linear>(d, d, false, o));
  }
  std::string name() const override { return "Attention"; }
  Tensor forward(const Tensor& x) override { return proj->forward(qkv->forward(x).narrow(-1, 0, x.size(-1))); }
};

struct Block : Module {
  std::shared_ptr<Attention> attn;
  Tensor gamma;
  Block(int64_t d, TensorOptions o) {
    gamma = register_parameter("gamma", Tensor::ones({d}, o));
    attn = register_module("attn", std::make_shared<Attention>(d, o));
    register_buffer("step", Tensor::zeros({1}, TensorOptions(DType::i64, o.device)));
    register_buffer("scratch", Tensor::zeros({d}, o), /*persistent=*/false);
  }
  std::string name() const override { return "Block"; }
  Tensor forward(const Tensor& x) override { return attn->forward(x) * gamma + x; }
};

struct Net : Module {
  std::shared_ptr<Embedding> embed;
  std::shared_ptr<ModuleList> blocks;
  std::shared_ptr<Linear> head;
  explicit Net(int64_t n_blocks = 4, int64_t d = 4, TensorOptions o = {}) {
    embed = register_module("embed", std::make_shared<Embedding>(10, d, std::nullopt, o));
    blocks = register_module("blocks", std::make_shared<ModuleList>());
    for (int64_t i = 0; i < n_blocks; ++i) blocks->push_back(std::make_shared<Block>(d, o));
    head = register_module("head", std::make_shared<Linear>(d, 2, true, o));
  }
  std::string name() const override { return "Net"; }
  Tensor forward(const Tensor& idx) override {
    Tensor h = embed->forward(idx);
    for (const auto& b : *blocks) h = b->forward(h);
    return head->forward(h);
  }
};

TEST(NnModule, HierarchicalNamesInRegistrationOrder) {
  Net net(4);
  const std::vector<std::string> names = names_of(net.named_parameters());
  std::vector<std::string> want = {"embed.weight"};
  for (int i = 0; i < 4; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    for (const char* s : {"gamma", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight"}) want.push_back(p + s);
  }
  want.push_back("head.weight");
  want.push_back("head.bias");
  EXPECT_EQ(names, want);
  EXPECT_EQ(net.parameters().size(), want.size());
  // The handles are the module's own tensors, not copies.
  EXPECT_TRUE(net.parameters()[0].is_same(net.embed->weight()));
  EXPECT_TRUE(net.named_parameters()[3].second.is_same(net.blocks->at<Block>(0)->attn->qkv->bias()));
  // Non-recursive: own parameters only.
  EXPECT_TRUE(net.named_parameters(false).empty());
  EXPECT_EQ(names_of(net.blocks->at<Block>(2)->named_parameters(false)), std::vector<std::string>{"gamma"});
  // Buffers: persistent and not, recursively.
  EXPECT_EQ(names_of(net.named_buffers()).size(), 8u);
  EXPECT_EQ(names_of(net.named_buffers())[1], "blocks.0.scratch");
  EXPECT_TRUE(net.submodule("blocks.3.attn.qkv") == net.blocks->at<Block>(3)->attn->qkv);
  expect_error([&] { net.submodule("blocks.4.attn"); }, {"submodule", "blocks.4.attn", "'4'"});
}

TEST(NnModule, NamedModulesAndChildren) {
  auto net = std::make_shared<Net>(2);
  std::vector<std::string> names;
  for (auto& [n, m] : net->named_modules()) names.push_back(n + ":" + m->name());
  const std::vector<std::string> want = {
      ":Net",           "embed:Embedding",         "blocks:ModuleList",       "blocks.0:Block",
      "blocks.0.attn:Attention", "blocks.0.attn.qkv:Linear", "blocks.0.attn.proj:Linear", "blocks.1:Block",
      "blocks.1.attn:Attention", "blocks.1.attn.qkv:Linear", "blocks.1.attn.proj:Linear", "head:Linear"};
  EXPECT_EQ(names, want);
  EXPECT_TRUE(net->named_modules()[0].second.get() == net.get());
  ASSERT_EQ(net->named_children().size(), 3u);
  EXPECT_EQ(net->named_children()[1].first, "blocks");
  EXPECT_EQ(net->children().size(), 3u);
  EXPECT_EQ(net->modules().size(), want.size());
}

TEST(NnModule, ApplyVisitsChildrenBeforeParents) {
  Net net(2);
  std::vector<std::string> order;
  net.apply([&](Module& m) { order.push_back(m.name()); });
  EXPECT_EQ(order, (std::vector<std::string>{"Embedding", "Linear", "Linear", "Attention", "Block", "Linear", "Linear",
                                             "Attention", "Block", "ModuleList", "Linear", "Net"}));
  // A custom init through apply reaches every Linear.
  net.apply([](Module& m) {
    if (auto* l = dynamic_cast<Linear*>(&m)) {
      Tensor w = l->weight();
      init::constant_(w, 0.5);
    }
  });
  EXPECT_EQ(net.head->weight().to_vec<float>(), std::vector<float>(8, 0.5f));
  EXPECT_EQ(net.blocks->at<Block>(1)->attn->proj->weight().to_vec<float>(), std::vector<float>(16, 0.5f));
}

TEST(NnModule, NestedContainersNameChildrenLikePyTorch) {
  auto inner = std::make_shared<Sequential>(
      std::initializer_list<ModulePtr>{std::make_shared<Linear>(3, 4), std::make_shared<ReLU>(), std::make_shared<Linear>(4, 2)});
  auto dict = std::make_shared<ModuleDict>();
  dict->insert("enc", inner);
  dict->insert("dec", std::make_shared<Linear>(2, 3, false));
  auto list = std::make_shared<ModuleList>(std::initializer_list<ModulePtr>{dict, std::make_shared<Linear>(3, 1)});
  Sequential root({list});
  EXPECT_EQ(names_of(root.named_parameters()),
            (std::vector<std::string>{"0.0.enc.0.weight", "0.0.enc.0.bias", "0.0.enc.2.weight", "0.0.enc.2.bias",
                                      "0.0.dec.weight", "0.1.weight", "0.1.bias"}));
  EXPECT_EQ(dict->keys(), (std::vector<std::string>{"enc", "dec"}));
  EXPECT_TRUE(dict->contains("dec"));
  EXPECT_FALSE(dict->contains("mid"));
  EXPECT_EQ(dict->at<Linear>("dec")->out_features(), 3);
  EXPECT_EQ(list->size(), 2u);
  EXPECT_EQ(inner->at<Linear>(2)->in_features(), 4);
  expect_error([&] { (*dict)["mid"]; }, {"ModuleDict", "mid"});
  expect_error([&] { (*list)[2]; }, {"ModuleList", "2"});
  expect_error([&] { inner->at<Linear>(1); }, {"Sequential::at", "ReLU"});
  expect_error([&] { dict->insert("enc", std::make_shared<ReLU>()); }, {"register_module", "enc"});
  // A container without forward says which module it is.
  expect_error([&] { (*list)(Tensor::ones({1, 3})); }, {"forward", "ModuleList"});
}

TEST(NnModule, SequentialChainsForward) {
  Generator gen(3);
  auto l1 = std::make_shared<Linear>(3, 5);
  auto l2 = std::make_shared<Linear>(5, 2);
  Sequential seq({l1, std::make_shared<Tanh>(), l2});
  const Tensor x = Tensor::randn({4, 3}, 0.0, 1.0, {}, &gen);
  const Tensor want = functional::linear(functional::linear(x, l1->weight(), l1->bias()).tanh(), l2->weight(), l2->bias());
  EXPECT_TRUE(all_close(seq(x), want, 1e-6, 1e-6));
  EXPECT_TRUE(all_close(Sequential()(x), x, 0, 0));
}

TEST(NnModule, RegistrationErrors) {
  Module m;
  m.register_parameter("w", Tensor::ones({2}));
  expect_error([&] { m.register_parameter("w", Tensor::ones({2})); }, {"register_parameter", "'w'"});
  expect_error([&] { m.register_buffer("w", Tensor::ones({2})); }, {"register_buffer", "'w'"});
  expect_error([&] { m.register_parameter("a.b", Tensor::ones({2})); }, {"register_parameter", "a.b"});
  expect_error([&] { m.register_parameter("", Tensor::ones({2})); }, {"register_parameter", "empty"});
  Tensor leaf = Tensor::ones({2}).requires_grad_();
  expect_error([&] { m.register_parameter("y", leaf * 2.0); }, {"register_parameter", "'y'", "leaves"});
  expect_error([&] { m.register_buffer("z", leaf); }, {"register_buffer", "requires grad"});
  expect_error([&] { m.forward(Tensor::ones({1})); }, {"forward", "Module"});
  // An undefined tensor (bias = None) registers nothing.
  m.register_parameter("bias", Tensor());
  EXPECT_EQ(m.parameters().size(), 1u);
  EXPECT_TRUE(m.parameters()[0].requires_grad());
}

TEST(NnModule, SharedParametersAndModulesListedOnce) {
  auto shared = std::make_shared<Linear>(2, 2);
  Sequential seq({shared, std::make_shared<ReLU>(), shared});
  EXPECT_EQ(names_of(seq.named_parameters()), (std::vector<std::string>{"0.weight", "0.bias"}));
  EXPECT_EQ(seq.named_modules().size(), 3u);  // root, 0, 1 (2 is the same module as 0)
  EXPECT_EQ(seq.num_parameters(), 6);
  // The state dict lists every key, as PyTorch's.
  EXPECT_EQ(seq.state_dict().keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
}

TEST(NnModule, TrainEvalPropagates) {
  Net net(2);
  EXPECT_TRUE(net.is_training());
  net.eval();
  for (auto& [n, m] : net.named_modules()) EXPECT_FALSE(m->is_training()) << n;
  net.blocks->train();
  EXPECT_FALSE(net.is_training());
  EXPECT_TRUE(net.blocks->at<Block>(1)->attn->qkv->is_training());
  net.train(true);
  for (auto& [n, m] : net.named_modules()) EXPECT_TRUE(m->is_training()) << n;
}

TEST(NnModule, FrozenSubtreeGetsNoGradientBuffer) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  Net net(2, 4, dev);
  net.blocks->at<Block>(0)->requires_grad_(false);
  EXPECT_EQ(net.num_parameters(), 10 * 4 + 2 * (4 + 48 + 12 + 16) + 8 + 2);
  EXPECT_EQ(net.num_parameters(true), net.num_parameters() - (4 + 48 + 12 + 16));
  const Tensor idx = Tensor::from_vec<int64_t>({1, 7, 3}, {3}, dev);
  Gradients g = net(idx).sum().backward();
  for (auto& [n, p] : net.named_parameters()) {
    const bool frozen = n.rfind("blocks.0.", 0) == 0;
    EXPECT_EQ(g.contains(p), !frozen) << n;
    if (!frozen) {
      EXPECT_GT(g.get(p).abs().sum().item<double>(), 0.0) << n;
    }
  }
  net.requires_grad_(true);
  Gradients g2 = net(idx).sum().backward();
  EXPECT_TRUE(g2.contains(net.blocks->at<Block>(0)->gamma));
}

TEST(NnModule, SetDataKeepsIdentityAndChecks) {
  Tensor p = Tensor::ones({2, 3}).requires_grad_();
  Tensor outside = p;  // a handle kept elsewhere (an optimizer's key)
  TensorImpl* impl = p.impl();
  const uint64_t v0 = p.version();
  p.set_data(Tensor::full({4}, 2.5, DType::f64));
  EXPECT_EQ(p.impl(), impl);
  EXPECT_EQ(outside.dtype(), DType::f64);
  EXPECT_EQ(outside.sizes(), (Shape{4}));
  EXPECT_EQ(outside.to_vec<double>(), std::vector<double>(4, 2.5));
  EXPECT_TRUE(outside.requires_grad());
  EXPECT_GT(p.version(), v0);
  Tensor y = p * 2.0;
  expect_error([&] { y.set_data(Tensor::ones({4})); }, {"set_data", "history"});
  Tensor base = Tensor::ones({4});
  Tensor view = base.narrow(0, 0, 2);
  expect_error([&] { view.set_data(Tensor::ones({2})); }, {"set_data", "view"});
  expect_error([&] { p.set_data(Tensor::ones({2}, DType::i64)); }, {"set_data", "i64"});
  // Gradients still reach the rebound tensor.
  Gradients g = (p * p).sum().backward();
  EXPECT_EQ(g.get(outside).to_vec<double>(), std::vector<double>(4, 5.0));
}

TEST(NnModule, ToDtypeKeepsParameterIdentity) {
  Net net(1);
  const auto before = net.named_parameters();
  Tensor outside = net.head->weight();
  const std::vector<double> values = outside.to_vec<double>();
  Tensor step = net.blocks->at<Block>(0)->buffer("step");
  net.to(DType::f64);
  const auto after = net.named_parameters();
  ASSERT_EQ(before.size(), after.size());
  for (std::size_t i = 0; i < before.size(); ++i) {
    EXPECT_EQ(before[i].second.impl(), after[i].second.impl()) << before[i].first;
    EXPECT_EQ(after[i].second.dtype(), DType::f64) << before[i].first;
    EXPECT_TRUE(after[i].second.requires_grad()) << before[i].first;
  }
  EXPECT_EQ(outside.dtype(), DType::f64);
  EXPECT_EQ(outside.to_vec<double>(), values);  // f32 -> f64 is exact
  EXPECT_TRUE(outside.is_same(net.head->weight()));
  EXPECT_EQ(step.dtype(), DType::i64);  // integer buffers keep their dtype
  EXPECT_EQ(net.blocks->at<Block>(0)->buffer("scratch").dtype(), DType::f64);
  // Training still works through the same handles.
  Gradients g = net(Tensor::from_vec<int64_t>({1, 2}, {2})).sum().backward();
  EXPECT_TRUE(g.contains(outside));
  EXPECT_EQ(g.get(outside).dtype(), DType::f64);
}

TEST(NnModuleCuda, ToDeviceKeepsIdentity) {
  FLAME_SKIP_IF_NO_CUDA();
  Net net(1);
  Tensor outside = net.blocks->at<Block>(0)->attn->qkv->weight();
  const std::vector<float> values = outside.to_vec<float>();
  net.to(Device::cuda());
  EXPECT_TRUE(outside.device().is_cuda());
  EXPECT_EQ(outside.to_vec<float>(), values);
  for (auto& [n, t] : net.named_buffers()) EXPECT_TRUE(t.device().is_cuda()) << n;
  net.to(DType::bf16, Device::cpu());
  EXPECT_TRUE(outside.device().is_cpu());
  EXPECT_EQ(outside.dtype(), DType::bf16);
  EXPECT_TRUE(outside.is_same(net.blocks->at<Block>(0)->attn->qkv->weight()));
}

TEST(NnModule, StateDictRoundTrip) {
  Generator gen(5);
  Net a(2), b(2);
  StateDict sd = a.state_dict();
  std::vector<std::string> want = {"embed.weight"};
  for (int i = 0; i < 2; ++i) {
    const std::string p = "blocks." + std::to_string(i) + ".";
    for (const char* s : {"gamma", "step", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight"}) want.push_back(p + s);
  }
  want.push_back("head.weight");
  want.push_back("head.bias");
  EXPECT_EQ(sd.keys(), want);  // own parameters, own persistent buffers, then children
  // The state dict shares storage with the module (PyTorch's state_dict is not a copy) and is
  // outside any graph.
  EXPECT_TRUE(sd.at("head.weight").shares_storage(a.head->weight()));
  EXPECT_FALSE(sd.at("head.weight").requires_grad());
  {
    NoGradGuard ng;
    Tensor g = a.blocks->at<Block>(1)->gamma;
    g.copy_(Tensor::randn({4}, 0.0, 1.0, {}, &gen));
  }
  Tensor b_head = b.head->weight();
  LoadReport r = b.load_state_dict(a.state_dict());
  EXPECT_TRUE(r.ok()) << r.to_string();
  EXPECT_TRUE(b_head.is_same(b.head->weight()));
  for (const auto& [k, t] : a.state_dict()) {
    EXPECT_TRUE(all_close(b.state_dict().at(k), t, 0, 0)) << k;
    EXPECT_FALSE(b.state_dict().at(k).shares_storage(t)) << k;  // copied, not aliased
  }
  // The loaded model computes what the source computes.
  const Tensor idx = Tensor::from_vec<int64_t>({4, 0, 9}, {3});
  EXPECT_TRUE(all_close(b(idx), a(idx), 0, 0));
}

TEST(NnModule, StrictLoadReportsEverythingAndChangesNothing) {
  Net a(1), b(1);
  StateDict sd = a.state_dict();
  sd.erase("head.bias");                                          // missing
  sd.insert("head.extra", Tensor::ones({1}));                      // unexpected
  sd.set("head.weight", Tensor::ones({3, 4}));                     // shape mismatch
  sd.set("blocks.0.gamma", Tensor::ones({4}, DType::f64));         // dtype mismatch
  const std::vector<float> before = b.embed->weight().to_vec<float>();
  expect_error([&] { b.load_state_dict(sd); },
               {"load_state_dict", "nothing was changed", "missing key 'head.bias'", "unexpected key 'head.extra'",
                "'head.weight'", "[2, 4] f32", "[3, 4] f32", "'blocks.0.gamma'", "[4] f64"});
  EXPECT_EQ(b.embed->weight().to_vec<float>(), before);  // strict failure changed nothing

  LoadReport r = b.load_state_dict(sd, /*strict=*/false);
  EXPECT_EQ(r.missing_keys, std::vector<std::string>{"head.bias"});
  EXPECT_EQ(r.unexpected_keys, std::vector<std::string>{"head.extra"});
  ASSERT_EQ(r.mismatched.size(), 2u);
  EXPECT_EQ(r.mismatched[0].name, "blocks.0.gamma");
  EXPECT_EQ(r.mismatched[0].got_dtype, DType::f64);
  EXPECT_EQ(r.mismatched[0].expected_dtype, DType::f32);
  EXPECT_EQ(r.mismatched[1].name, "head.weight");
  EXPECT_EQ(r.mismatched[1].expected_shape, (Shape{2, 4}));
  EXPECT_EQ(r.mismatched[1].got_shape, (Shape{3, 4}));
  // What matched was loaded; what did not kept its value.
  EXPECT_TRUE(all_close(b.embed->weight(), a.embed->weight(), 0, 0));
  EXPECT_FALSE(all_close(b.head->weight(), a.head->weight(), 0, 0));
}

TEST(NnModuleCuda, LoadStateDictAcrossDevices) {
  FLAME_SKIP_IF_NO_CUDA();
  Net a(1), b(1);
  b.to(Device::cuda());
  Tensor handle = b.head->weight();
  EXPECT_TRUE(b.load_state_dict(a.state_dict()).ok());
  EXPECT_TRUE(handle.device().is_cuda());
  EXPECT_TRUE(all_close(handle.to(Device::cpu()), a.head->weight(), 0, 0));
}

TEST(NnModule, SummaryReadsLikePyTorch) {
  Sequential seq({std::make_shared<Linear>(4, 8), std::make_shared<GELU>("tanh"), std::make_shared<Dropout>(0.1),
                  std::make_shared<Linear>(8, 2, false)});
  EXPECT_EQ(seq.to_string(),
            "Sequential(\n"
            "  (0): Linear(in_features=4, out_features=8, bias=True)\n"
            "  (1): GELU(approximate='tanh')\n"
            "  (2): Dropout(p=0.1, inplace=False)\n"
            "  (3): Linear(in_features=8, out_features=2, bias=False)\n"
            ")");
  Net net(1);
  std::ostringstream os;
  os << net;
  EXPECT_NE(os.str().find("  (blocks): ModuleList(\n    (0): Block(\n      (attn): Attention(\n"), std::string::npos)
      << os.str();
  EXPECT_NE(os.str().find("(embed): Embedding(10, 4)"), std::string::npos);
}

}  // namespace
}  // namespace flame::test
