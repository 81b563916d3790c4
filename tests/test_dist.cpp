// flame::dist: process groups, DDP, ZeRO-1 and ZeRO-2, the launcher and failure handling, with real
// processes. Each multi-rank case starts N processes of this test binary (fork + exec) with the
// torchrun environment and FLAME_DIST_WORKER=<worker>; a static initialiser below runs the worker
// in those processes and exits before GoogleTest starts, so workers are not test cases. Workers
// check their own results against a single-process reference they compute themselves and exit
// non-zero on any mismatch; the parent case asserts on the exit statuses (and on the output, for
// the failure cases).
//
// Backend: "tcp" on the CPU (CI); with FLAME_TEST_DEVICE=cuda, "nccl" with one GPU per rank, and
// the cases skip (with a message) on a machine with fewer than 2 GPUs.
#include <filesystem>

#include "test_dist_util.h"

namespace flame::test::dist_test {
namespace {

// ---- in-process cases ----

TEST(DistStore, SetGetAddWaitAndTimeouts) {
  using namespace std::chrono_literals;
  dist::TCPStore server("127.0.0.1", 0, 0, 2, true, std::chrono::milliseconds(2000));
  const int port = server.port();
  ASSERT_GT(port, 0);
  std::thread t([&] {
    dist::TCPStore client("127.0.0.1", port, 1, 2, false, std::chrono::milliseconds(2000));
    std::this_thread::sleep_for(50ms);
    client.set("late", "value-from-1");
    EXPECT_EQ(client.add("counter", 5), 5);
  });
  EXPECT_EQ(server.get("late"), "value-from-1");  // waits for the other rank's set
  t.join();
  EXPECT_EQ(server.add("counter", 2), 7);
  EXPECT_FALSE(server.try_get("missing").has_value());
  const auto start = std::chrono::steady_clock::now();
  try {
    server.wait({"never"}, std::chrono::milliseconds(300));
    FAIL() << "wait on a missing key did not time out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("never"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  EXPECT_TRUE(server.dead_ranks().empty());  // the client said goodbye
}

TEST(DistStore, ClosedConnectionMarksRankDead) {
  dist::TCPStore server("127.0.0.1", 0, 0, 3, true, std::chrono::milliseconds(2000));
  const int port = server.port();
  const pid_t pid = fork();
  if (pid == 0) {
    // A rank that connects and dies without a goodbye.
    dist::TCPStore client("127.0.0.1", port, 2, 3, false, std::chrono::milliseconds(2000));
    client.set("alive", "1");
    _exit(0);
  }
  ASSERT_GT(pid, 0);
  EXPECT_EQ(server.get("alive"), "1");
  int status = 0;
  waitpid(pid, &status, 0);
  EXPECT_EQ(server.get("dist/dead/2"), "1");
  EXPECT_EQ(server.dead_ranks(), std::vector<int>{2});
}

TEST(DistEnv, ReadsTorchrunSlurmAndMpiVariables) {
  EnvGuard guard({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID",
                  "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_RANK",
                  "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"});
  dist::EnvInfo e = dist::env_info();
  EXPECT_EQ(e.source, "none");
  EXPECT_EQ(e.world_size, 1);
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_NTASKS", "8", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("MASTER_ADDR", "node17", 1);
  setenv("MASTER_PORT", "12345", 1);
  e = dist::env_info();
  EXPECT_EQ(e.source, "slurm");
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node17");
  EXPECT_EQ(e.master_port, 12345);
  unsetenv("SLURM_PROCID");
  setenv("OMPI_COMM_WORLD_RANK", "3", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  e = dist::env_info();
  EXPECT_EQ(e.source, "mpi");
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "6", 1);
  setenv("LOCAL_RANK", "0", 1);
  e = dist::env_info();  // torchrun's variables win
  EXPECT_EQ(e.source, "torchrun");
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world_size, 6);
  setenv("RANK", "6", 1);
  EXPECT_THROW(dist::env_info(), Error);  // rank outside the world
  setenv("RANK", "x", 1);
  EXPECT_THROW(dist::env_info(), Error);
}

TEST(DistSampler, ShardsCoverTheDatasetAndReshufflePerEpoch) {
  for (int world : {1, 2, 3, 4}) {
    for (int64_t n : {0, 1, 10, 11, 17}) {
      std::vector<int64_t> count(static_cast<std::size_t>(n), 0);
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        dist::DistributedSampler s(n, world, r, true, 7);
        s.set_epoch(3);
        const auto idx = s.indices();
        EXPECT_EQ(static_cast<int64_t>(idx.size()), s.num_samples());
        total += static_cast<int64_t>(idx.size());
        for (int64_t i : idx) {
          ASSERT_GE(i, 0);
          ASSERT_LT(i, n);
          ++count[static_cast<std::size_t>(i)];
        }
      }
      EXPECT_EQ(total, n == 0 ? 0 : (n + world - 1) / world * world);
      for (int64_t c : count) EXPECT_GE(c, 1);  // every item seen (padding repeats some)
    }
  }
  dist::DistributedSampler a(100, 2, 0, true, 1);
  const auto e0 = a.indices();
  a.set_epoch(1);
  const auto e1 = a.indices();
  EXPECT_NE(e0, e1);  // reshuffled per epoch
  a.set_epoch(0);
  EXPECT_EQ(a.indices(), e0);  // deterministic
  dist::DistributedSampler d(11, 4, 3, false, 0, /*drop_last=*/true);
  EXPECT_EQ(d.num_samples(), 2);
  EXPECT_EQ(d.indices(), (std::vector<int64_t>{3, 7}));
  EXPECT_THROW(dist::DistributedSampler(10, 2, 2), Error);
}

TEST(DistProcessGroup, NotInitialisedAndBadInputsRaise) {
  EXPECT_FALSE(dist::is_initialized());
  EXPECT_EQ(dist::get_world_size(), 1);
  EXPECT_THROW(dist::default_group(), Error);
  auto store = std::make_shared<dist::TCPStore>("127.0.0.1", 0, 0, 1, true, std::chrono::milliseconds(2000));
  auto pg = dist::new_group("tcp", store, 0, 1, 0, std::chrono::milliseconds(2000));
  Tensor t = Tensor::from_vec(std::vector<float>{1, 2, 3, 4, 5, 6}, {2, 3});
  pg->all_reduce(t, dist::ReduceOp::avg);
  EXPECT_EQ(t.to_vec<float>(), (std::vector<float>{1, 2, 3, 4, 5, 6}));  // a world of one
  Tensor nc = t.transpose(0, 1);
  EXPECT_THROW(pg->all_reduce(nc), Error);  // not contiguous
  Tensor ints = Tensor::from_vec(std::vector<int64_t>{1, 2}, {2});
  EXPECT_THROW(pg->all_reduce(ints, dist::ReduceOp::avg), Error);
  Tensor out = Tensor::empty({5});
  EXPECT_THROW(pg->all_gather(out, t), Error);  // wrong size
  EXPECT_THROW(dist::new_group("gloo", store, 0, 1, 0, std::chrono::milliseconds(100)), Error);
}

TEST(DistProcessGroup, InitFromAnEmptyEnvironmentIsAWorldOfOne) {
  EnvGuard guard({"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
                  "OMPI_COMM_WORLD_RANK", "FLAME_DIST_TIMEOUT"});
  dist::ProcessGroupOptions o;
  o.backend = "tcp";
  dist::init_process_group(o);
  EXPECT_TRUE(dist::is_initialized());
  EXPECT_EQ(dist::get_world_size(), 1);
  EXPECT_EQ(dist::get_rank(), 0);
  EXPECT_EQ(dist::default_group().backend(), "tcp");
  EXPECT_THROW(dist::init_process_group(o), Error);  // already initialised
  Tensor t = Tensor::from_vec(std::vector<float>{3, -1}, {2});
  uint64_t v = t.version();
  dist::default_group().all_reduce(t, dist::ReduceOp::max);
  EXPECT_EQ(t.to_vec<float>(), (std::vector<float>{3, -1}));
  // Collectives write in place and say so (Note [Collectives write in place]).
  EXPECT_GT(t.version(), v);
  v = t.version();
  dist::default_group().broadcast(t, 0);
  EXPECT_GT(t.version(), v);
  Tensor gathered = Tensor::empty({2});
  v = gathered.version();
  dist::default_group().all_gather(gathered, t);
  EXPECT_GT(gathered.version(), v);
  EXPECT_EQ(gathered.to_vec<float>(), (std::vector<float>{3, -1}));
  Tensor scattered = Tensor::empty({2});
  v = scattered.version();
  dist::default_group().reduce_scatter(scattered, t);
  EXPECT_GT(scattered.version(), v);
  dist::default_group().barrier();
  dist::destroy_process_group();
  EXPECT_FALSE(dist::is_initialized());
}

TEST(DistAutogradHook, PostAccumulateHookSeesTheAccumulatedGradientOfLeavesOnly) {
  Tensor w = Tensor::from_vec(std::vector<float>{0.5f, -1.5f, 2.0f}, {3}).requires_grad_(true);
  std::vector<std::vector<float>> seen;
  w.register_post_accumulate_grad_hook([&](const Tensor& g) { seen.push_back(g.to_vec<float>()); });
  Gradients store;
  BackwardOptions into;
  into.accumulate_into = &store;
  (void)(w * w).sum().backward(into);      // 2w
  (void)(w * 3.0).sum().backward(into);    // + 3
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0], (std::vector<float>{1.0f, -3.0f, 4.0f}));
  EXPECT_EQ(seen[1], (std::vector<float>{4.0f, 0.0f, 7.0f}));  // the store's sum, not the new part
  Tensor y = w * 2.0;
  EXPECT_THROW(y.register_post_accumulate_grad_hook([](const Tensor&) {}), Error);  // not a leaf
  Tensor frozen = Tensor::ones({2});
  EXPECT_THROW(frozen.register_post_accumulate_grad_hook([](const Tensor&) {}), Error);
}

TEST(DistDDP, OneRankGroupReducesAndGuardsMisuse) {
  auto store = std::make_shared<dist::TCPStore>("127.0.0.1", 0, 0, 1, true, std::chrono::milliseconds(2000));
  auto pg = dist::new_group("tcp", store, 0, 1, 0, std::chrono::milliseconds(2000));
  auto model = std::make_shared<nn::Linear>(4, 3);
  dist::DistributedDataParallel ddp(model, {}, pg);
  EXPECT_EQ(ddp.num_buckets(), 1u);
  const Tensor x = Tensor::randn({5, 4});
  Gradients g = ddp(x).square().mean().backward();
  const Tensor before = g.get(model->weight()).clone();
  ddp.finish_gradients(g);  // a world of one: the average is the gradient itself
  EXPECT_EQ(g.get(model->weight()).to_vec<float>(), before.to_vec<float>());
  EXPECT_EQ(ddp.last_launch_times().size(), 1u);
  // Two backward passes into one store without no_sync: the second delivery comes after the
  // bucket was reduced, which would silently drop it; it raises naming the parameter.
  Gradients acc;
  BackwardOptions into;
  into.accumulate_into = &acc;
  (void)ddp(x).sum().backward(into);
  try {
    (void)ddp(x).sum().backward(into);
    FAIL() << "a second backward without no_sync did not raise";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no_sync"), std::string::npos) << e.what();
  }
  // A module on another device than the group's raises at construction.
  if (cuda_is_available()) {
    auto gpu = std::make_shared<nn::Linear>(2, 2);
    gpu->to(Device::cuda(0));
    EXPECT_THROW(dist::DistributedDataParallel(gpu, {}, pg), Error);
  }
}

// ---- multi-process cases ----

TEST(DistCollectives, MatchLocalReferenceOnTwoAndFourRanks) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 4}) {
    if (world > max_ranks()) continue;  // nccl: one GPU per rank
    const auto r = run_ranks("collectives", world, {});
    EXPECT_TRUE(r.all_ok()) << r.report();
  }
}

TEST(DistDDP, MatchesOneProcessWithTheGlobalBatchOnTwoAndFourRanks) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 4}) {
    if (world > max_ranks()) continue;
    const auto r = run_ranks("ddp", world, {});
    EXPECT_TRUE(r.all_ok()) << r.report();
  }
}

TEST(DistDDP, Bf16ReductionHalvesTheBucketsAndFollowsOneProcess) {
  DIST_SKIP_UNLESS_RANKS(2);
  const auto r = run_ranks("ddp_bf16", 2, {});
  EXPECT_TRUE(r.all_ok()) << r.report();
}

TEST(DistDDP, RejectsAReduceDtypeThatIsNotAFloat) {
  auto model = std::make_shared<nn::Linear>(3, 2);
  try {
    dist::DistributedDataParallel ddp(model, dist::DDPOptions{.reduce_dtype = DType::i32});
    ADD_FAILURE() << "an i32 reduce_dtype was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reduce_dtype must be bf16, f16 or f32, got i32"), std::string::npos)
        << e.what();
  }
}

TEST(DistDDP, CapturedInACudaGraphMatchesOneProcessOnTwoRanks) {
  DIST_SKIP_UNLESS_RANKS(2);
  if (!using_nccl()) GTEST_SKIP() << "CUDA graphs hold collectives on the nccl backend only (FLAME_TEST_DEVICE=cuda)";
  const auto r = run_ranks("ddp_graph", 2, {});
  EXPECT_TRUE(r.all_ok()) << r.report();
}

// Options that do not fit the stage raise at construction, naming the option and the stage.
TEST(DistZero, RejectsOptionsOfAnotherStage) {
  auto store = std::make_shared<dist::TCPStore>("127.0.0.1", 0, 0, 1, true, std::chrono::milliseconds(2000));
  auto pg = dist::new_group("tcp", store, 0, 1, 0, std::chrono::milliseconds(2000));
  auto model = std::make_shared<nn::Linear>(4, 3);
  const auto make = [&](dist::ZeroOptions o) {
    dist::ZeroRedundancyOptimizer opt({optim::AdamWOptions{.lr = 1e-3}.group(model->parameters())},
                                      [](std::vector<optim::ParamGroup> g) {
                                        return std::make_unique<optim::AdamW>(std::move(g), optim::AdamWOptions{});
                                      },
                                      pg, std::move(o));
  };
  const auto expect = [&](dist::ZeroOptions o, const std::string& part) {
    try {
      make(std::move(o));
      ADD_FAILURE() << "accepted; expected an error with: " << part;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  dist::ZeroOptions one;
  one.reduce_dtype = DType::bf16;
  expect(one, "reduce_dtype is for stages 2 and 3 (a floating dtype), got bf16 with stage 1");
  dist::ZeroOptions two;
  two.stage = 2;
  two.reduce_dtype = DType::i32;
  expect(two, "got i32 with stage 2");
  two.reduce_dtype = DType::bf16;
  EXPECT_NO_THROW(make(two));
  dist::ZeroOptions three;
  three.stage = 3;
  expect(three, "give the model's blocks");
}

TEST(DistZero, MatchesOneProcessAdamWAndConsolidatesItsState) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3, 4}) {
    if (world > max_ranks()) continue;
    const auto r = run_ranks("zero", world, {});
    EXPECT_TRUE(r.all_ok()) << r.report();
  }
}

TEST(DistZero, StageTwoShardsGradientsDuringTheBackwardAndMatchesOneProcess) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3, 4}) {
    if (world > max_ranks()) continue;
    for (bool ckpt : {false, true}) {  // with gradient checkpointing the gradients come from the recompute
      SCOPED_TRACE(ckpt ? "checkpointed" : "plain");
      const auto r = run_ranks("zero2", world, ckpt ? std::map<std::string, std::string>{{"FLAME_DIST_TEST_CKPT", "1"}}
                                                    : std::map<std::string, std::string>{});
      EXPECT_TRUE(r.all_ok()) << r.report();
    }
  }
}

TEST(DistZero, StageThreeShardsParametersPerBlockAndMatchesOneProcess) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3, 4}) {
    if (world > max_ranks()) continue;
    // bf16: compute_dtype over f32 shards, under autocast; then also the gradients reduced in bf16.
    for (int mode : {0, 1, 2}) {
      SCOPED_TRACE(mode == 0 ? "f32" : mode == 1 ? "bf16 compute" : "bf16 compute and reduction");
      std::map<std::string, std::string> env;
      if (mode >= 1) env["FLAME_DIST_TEST_BF16"] = "1";
      if (mode == 2) env["FLAME_DIST_TEST_BF16_REDUCE"] = "1";
      const auto r = run_ranks("zero3", world, env);
      EXPECT_TRUE(r.all_ok()) << r.report();
    }
  }
}

// ZeroOptions::ema: the average kept over the shards equals one process's EMA, swaps in and out,
// and travels in the consolidated state (tests/test_dist_workers.cpp zero_ema).
TEST(DistZero, KeepsAnEmaOfTheShardsAndConsolidatesIt) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3}) {
    if (world > max_ranks()) continue;
    for (const char* stage : {"2", "3"}) {
      SCOPED_TRACE(std::string("stage ") + stage);
      const auto r = run_ranks("zero_ema", world, {{"FLAME_DIST_TEST_STAGE", stage}});
      EXPECT_TRUE(r.all_ok()) << r.report();
    }
  }
}

// ZeroOptions::offload_state: the optimizer state on the host, one process's trajectory and state,
// and weights loaded between steps reach the host masters (tests/test_dist_workers.cpp zero_offload).
TEST(DistZero, OffloadedStateOnTheHostMatchesOneProcess) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3}) {
    if (world > max_ranks()) continue;
    for (const char* stage : {"1", "2", "3"}) {
      SCOPED_TRACE(std::string("stage ") + stage);
      const auto r = run_ranks("zero_offload", world, {{"FLAME_DIST_TEST_STAGE", stage}});
      EXPECT_TRUE(r.all_ok()) << r.report();
    }
  }
}

// ZeRO over AdamW8bit: one process's trajectory within the quantisation's reach, AdamW8bit's own
// consolidated format, and resumes from the consolidated state and the shard files
// (tests/test_dist_workers.cpp zero_8bit).
TEST(DistZero, EightBitStateShardsAndConsolidatesInAdamW8bitsFormat) {
  DIST_SKIP_UNLESS_RANKS(2);
  for (int world : {2, 3}) {
    if (world > max_ranks()) continue;
    for (const char* stage : {"1", "2", "3"}) {
      SCOPED_TRACE(std::string("stage ") + stage + ", " + std::to_string(world) + " ranks");
      const auto r = run_ranks("zero_8bit", world, {{"FLAME_DIST_TEST_STAGE", stage}});
      EXPECT_TRUE(r.all_ok()) << r.report();
    }
  }
}

TEST(DistCheckpoint, FourRankCheckpointResumesOnTwoRanks) {
  DIST_SKIP_UNLESS_RANKS(2);
  // 4 ranks -> 2 (tcp, or nccl with 4 GPUs); 2 GPUs: 2 -> 1. Either way another world size.
  const int save_world = max_ranks() >= 4 ? 4 : 2;
  TempDir dir;
  const auto a = run_ranks("ckpt_save", save_world, {{"FLAME_DIST_TEST_DIR", dir.path}});
  ASSERT_TRUE(a.all_ok()) << a.report();
  const auto b = run_ranks("ckpt_resume", save_world / 2, {{"FLAME_DIST_TEST_DIR", dir.path}});
  EXPECT_TRUE(b.all_ok()) << b.report();
}

// ZeRO-2 with one shard file per rank: saved by 4 ranks (tcp; nccl with 4 GPUs; else 2), resumed on
// 2 and on 3 (another split of every bucket); an incomplete set is refused naming what is missing.
TEST(DistCheckpoint, ShardFilesSavedByFourRanksResumeOnTwoAndThree) {
  DIST_SKIP_UNLESS_RANKS(2);
  const int save_world = max_ranks() >= 4 ? 4 : 2;
  TempDir dir;
  const std::map<std::string, std::string> env{{"FLAME_DIST_TEST_DIR", dir.path}, {"FLAME_DIST_TEST_SHARDED", "1"}};
  const auto a = run_ranks("ckpt_save", save_world, env);
  ASSERT_TRUE(a.all_ok()) << a.report();
  EXPECT_TRUE(std::filesystem::exists(dir.path + "/optim/optimizer-shards.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir.path + "/optim/optimizer-rank" + std::to_string(save_world - 1) + "-of-" +
                                      std::to_string(save_world) + ".safetensors"));
  for (int world : {save_world / 2, 3}) {
    if (world > max_ranks() || world == save_world) continue;
    std::filesystem::remove_all(dir.path + "/broken");
    const auto b = run_ranks("ckpt_resume", world, env);
    EXPECT_TRUE(b.all_ok()) << "resumed on " << world << " ranks\n" << b.report();
  }
}

TEST(DistFailure, KilledRankMakesTheOthersFailNamingItWithinTheTimeout) {
  DIST_SKIP_UNLESS_RANKS(2);
  const int world = std::min(3, max_ranks());
  const int timeout_s = using_nccl() ? 15 : 20;
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_ranks("die", world, {{"FLAME_DIST_TIMEOUT", std::to_string(timeout_s)}}, 90);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(r.status.size(), static_cast<std::size_t>(world));
  EXPECT_TRUE(WIFSIGNALED(r.status[1]) && WTERMSIG(r.status[1]) == SIGKILL) << r.report();
  for (int k = 0; k < world; ++k) {
    if (k == 1) continue;
    EXPECT_FALSE(WIFEXITED(r.status[static_cast<std::size_t>(k)]) && WEXITSTATUS(r.status[static_cast<std::size_t>(k)]) == 0)
        << "rank " << k << " did not fail\n" << r.report();
    EXPECT_NE(r.output[static_cast<std::size_t>(k)].find("rank 1"), std::string::npos)
        << "rank " << k << "'s error does not name rank 1\n" << r.report();
  }
  EXPECT_LT(secs, timeout_s + 20.0) << r.report();
}

// A rank that comes to the failing collective after rank 0 has already aborted and exited: its
// send to rank 0 fails, and its error still names rank 1 (rank 0's abort report, read from the
// socket after the failed send), not the rank 0 that merely went away.
TEST(DistFailure, LateRankStillNamesTheKilledRank) {
  DIST_SKIP_UNLESS_RANKS(3);
  if (using_nccl()) GTEST_SKIP() << "the abort report is the tcp group's (FLAME_TEST_DEVICE=cpu)";
  const auto r = run_ranks("die", 3, {{"FLAME_DIST_TIMEOUT", "20"}, {"FLAME_DIST_TEST_LATE_RANK", "2"}}, 90);
  ASSERT_EQ(r.status.size(), 3u);
  EXPECT_FALSE(WIFEXITED(r.status[2]) && WEXITSTATUS(r.status[2]) == 0) << r.report();
  EXPECT_NE(r.output[2].find("rank 1"), std::string::npos) << "rank 2's error does not name rank 1\n" << r.report();
}

TEST(DistFailure, PeerStoppingDuringGraphReplaysFailsTheOthersWithinTheTimeout) {
  DIST_SKIP_UNLESS_RANKS(2);
  if (!using_nccl()) GTEST_SKIP() << "CUDA graphs hold collectives on the nccl backend only (FLAME_TEST_DEVICE=cuda)";
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_ranks("graph_hang", 2, {{"FLAME_DIST_TIMEOUT", "3"}}, 40, /*kill_after=*/1);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Rank 0 fails: its next watch() raises (status 3) or the exit timer ends it (status 1).
  const int s0 = r.status[0];
  EXPECT_TRUE(WIFEXITED(s0) && (WEXITSTATUS(s0) == 1 || WEXITSTATUS(s0) == 3)) << r.report();
  EXPECT_NE(r.output[0].find("did not finish within"), std::string::npos) << r.report();
  EXPECT_NE(r.output[0].find("graph replay"), std::string::npos) << r.report();
  EXPECT_LT(secs, 30.0) << r.report();
}

TEST(DistFailure, HungRankTimesOutNamingIt) {
  DIST_SKIP_UNLESS_RANKS(3);
  if (using_nccl()) GTEST_SKIP() << "the NCCL watchdog cannot tell which peer hangs; the tcp run covers naming it";
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_ranks("hang", 3, {{"FLAME_DIST_TIMEOUT", "3"}}, 40, /*kill_after_first_failures=*/2);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (int k : {0, 2}) {
    EXPECT_TRUE(WIFEXITED(r.status[static_cast<std::size_t>(k)]) && WEXITSTATUS(r.status[static_cast<std::size_t>(k)]) == 3)
        << r.report();
    EXPECT_NE(r.output[static_cast<std::size_t>(k)].find("rank 1"), std::string::npos) << r.report();
  }
  EXPECT_LT(secs, 30.0);
}

TEST(DistLauncher, ReportsTheKilledRankAndStopsTheOthers) {
  DIST_SKIP_UNLESS_RANKS(2);
  const std::string n = std::to_string(std::min(3, max_ranks()));
  const auto start = std::chrono::steady_clock::now();
  const auto r = run_launcher({"--nproc-per-node", n, "--grace", "3"}, "die", {{"FLAME_DIST_TIMEOUT", "60"}}, 90);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 128 + SIGKILL) << r.output;
  EXPECT_NE(r.output.find("rank 1 (local rank 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("SIGKILL"), std::string::npos) << r.output;
  EXPECT_LT(secs, 40.0) << r.output;  // far below the 60 s collective timeout: the launcher stopped them
}

TEST(DistLauncher, ForwardsSigtermToTheRanks) {
  const auto r = run_launcher({"--nproc-per-node", "2", "--grace", "5"}, "sleep", {}, 60, /*sigterm_after_s=*/1.5);
  EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 128 + SIGTERM) << r.output;
  EXPECT_NE(r.output.find("forwarding"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("grace period over"), std::string::npos) << r.output;  // they stopped on SIGTERM
}

TEST(DistLauncher, TwoNodesOnOneHostBootstrapOverTcp) {
  DIST_SKIP_UNLESS_RANKS(2);
  // Two launchers ("nodes") of two ranks each (one each on a 2-GPU nccl machine, each "node"
  // seeing its own GPU); with NCCL the traffic is forced onto the network transport (no
  // peer-to-peer, no shared memory), as between hosts.
  const int per_node = max_ranks() >= 4 ? 2 : 1;
  const int port = free_port();
  const std::string master = "127.0.0.1:" + std::to_string(port);
  auto node = [&](int k) {
    std::map<std::string, std::string> env;
    if (using_nccl()) {
      // Both "nodes" are this host: the socket transport over loopback (no InfiniBand loopback).
      env = {{"NCCL_P2P_DISABLE", "1"}, {"NCCL_SHM_DISABLE", "1"}, {"NCCL_SOCKET_IFNAME", "lo"}, {"NCCL_IB_DISABLE", "1"}};
      std::string vis;
      for (int l = 0; l < per_node; ++l) vis += (l ? "," : "") + std::to_string(k * per_node + l);
      env["CUDA_VISIBLE_DEVICES"] = vis;
    }
    return std::async(std::launch::async, [=] {
      return run_launcher({"--nproc-per-node", std::to_string(per_node), "--nnodes", "2", "--node-rank",
                           std::to_string(k), "--master", master},
                          "collectives", env, 120);
    });
  };
  auto n0 = node(0);
  auto n1 = node(1);
  const auto r0 = n0.get();
  const auto r1 = n1.get();
  EXPECT_TRUE(WIFEXITED(r0.status) && WEXITSTATUS(r0.status) == 0) << r0.output;
  EXPECT_TRUE(WIFEXITED(r1.status) && WEXITSTATUS(r1.status) == 0) << r1.output;
}

}  // namespace
}  // namespace flame::test::dist_test
