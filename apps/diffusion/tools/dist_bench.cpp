// dist_bench: weak scaling of a DiT training step with DistributedDataParallel (docs/distributed.md).
//
//   dist_bench --model dit-s --batch 64 --steps 30                      # one GPU
//   flame-run --nproc-per-node 2 dist_bench --model dit-s --batch 64    # two GPUs, 64 per GPU
//   flame-run --nproc-per-node 2 dist_bench --mode graph                # the step as one CUDA graph
//
// Per-GPU batch fixed; random images, times and labels (no data set); flow-matching MSE loss,
// bf16 autocast, AdamW. Rank 0 prints a BENCH line (median step time over the timed steps,
// images/s over all ranks) and the overlap of the all-reduces with backward, from CUDA events:
// when each bucket was launched (its gradients ready on the GPU) against the end of backward,
// and how long after the end of backward the last reduction finished. The PyTorch twin is
// bench/bench_dist_torch.py (torchrun, DistributedDataParallel), same names and shapes.
// --mode graph captures forward, backward, the bucket all-reduces and the (capturable) AdamW step
// into one cuda::GraphedStep, as the trainer's --compile does (the first `warmup` steps eager,
// then capture + replays; the BENCH name ends in /graph); a captured step records no launch
// events, so it prints no overlap line. --reduce bf16 all-reduces the f32 gradients in bf16
// (DDPOptions::reduce_dtype; the name ends in /bf16reduce).
#include <flame/amp.h>
#include <flame/cuda.h>
#include <flame/cuda/graph_step.h>
#include <flame/dist.h>
#include <flame/flame.h>
#include <flame/optim/optimizers.h>

#include <algorithm>
#include <optional>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "distributed.h"
#include "embed.h"

using namespace flame;
using namespace flame_diffusion;

int main(int argc, char** argv) {
  std::string preset = "dit-s";
  int64_t batch = 64;
  int steps = 30, warmup = 5;
  std::string mode = "eager";
  std::optional<DType> reduce;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--model") preset = argv[i + 1];
    else if (a == "--batch") batch = std::atoll(argv[i + 1]);
    else if (a == "--steps") steps = std::atoi(argv[i + 1]);
    else if (a == "--warmup") warmup = std::atoi(argv[i + 1]);
    else if (a == "--mode" && (std::string(argv[i + 1]) == "eager" || std::string(argv[i + 1]) == "graph"))
      mode = argv[i + 1];
    else if (a == "--reduce" && std::string(argv[i + 1]) == "bf16")
      reduce = DType::bf16;
    else {
      std::fprintf(stderr,
                   "usage: dist_bench [--model P] [--batch PER_GPU] [--steps N] [--warmup N] [--mode eager|graph] "
                   "[--reduce bf16]\n");
      return 2;
    }
  }
  try {
    if (!cuda_is_available()) {
      std::fprintf(stderr, "dist_bench: needs a GPU\n");
      return 2;
    }
    const Device dev = init_distributed(Device::cuda(0));
    const int world = dist_world(), rank = dist_rank();
    manual_seed(0);
    auto model = make_model(preset, 0);
    model->to(dev);
    const bool graph = mode == "graph";
    std::unique_ptr<dist::DistributedDataParallel> ddp;
    if (world > 1)
      ddp = std::make_unique<dist::DistributedDataParallel>(
          model, dist::DDPOptions{.record_launch_events = true, .reduce_dtype = reduce});
    optim::AdamW opt(model->parameters(), {.lr = 1e-4, .weight_decay = 0.0, .capturable = graph});
    Generator gen(1234 + static_cast<uint64_t>(rank));
    const int64_t C = model->in_channels(), S = model->image_size();
    const Tensor x0 = Tensor::randn({batch, C, S, S}, 0, 1, TensorOptions(DType::f32, dev), &gen);
    const Tensor noise = Tensor::randn({batch, C, S, S}, 0, 1, TensorOptions(DType::f32, dev), &gen);
    const Tensor t = Tensor::rand({batch}, TensorOptions(DType::f32, dev), &gen);
    const Tensor y = Tensor::randint(0, model->num_classes(), {batch}, TensorOptions(DType::i64, dev), &gen);
    const Tensor tb = t.reshape({batch, 1, 1, 1});
    const Tensor xt = x0 * (1.0 - tb) + noise * tb;
    const Tensor target = noise - x0;

    std::vector<double> step_ms, first_launch_ms, bwd_ms, tail_ms;
    std::size_t buckets = ddp ? ddp->num_buckets() : 0;
    if (graph) {
      cuda::GraphedStep step(
          [&] {
            Tensor loss;
            {
              amp::AutocastGuard ac(DType::bf16, DeviceType::cuda);
              loss = mse_loss(model->forward(xt, t, y).to(DType::f32), target);
            }
            Gradients g = loss.backward();
            if (ddp) ddp->finish_gradients(g);
            opt.step(g);
          },
          cuda::GraphedStepOptions{.warmup_steps = std::max(1, warmup), .device = dev.index});
      for (int s = 0; s < std::max(1, warmup) + 1 + steps; ++s) {  // warm-up, capture, timed replays
        cuda::Event start(true), end(true);
        start.record(cuda::Stream::current(dev.index));
        step();
        end.record(cuda::Stream::current(dev.index));
        if (world > 1) dist::default_group().watch("dist_bench step");
        end.synchronize();
        if (step.replays() > 1) step_ms.push_back(start.elapsed_time(end));
      }
    }
    for (int s = 0; !graph && s < warmup + steps; ++s) {
      cuda::Event start(true), bwd_end(true), reduced(true), end(true);
      start.record(cuda::Stream::current(dev.index));
      Tensor loss;
      {
        amp::AutocastGuard ac(DType::bf16, DeviceType::cuda);
        loss = mse_loss(model->forward(xt, t, y).to(DType::f32), target);
      }
      Gradients g = loss.backward();
      bwd_end.record(cuda::Stream::current(dev.index));
      if (ddp) ddp->finish_gradients(g);
      reduced.record(cuda::Stream::current(dev.index));
      opt.step(g);
      end.record(cuda::Stream::current(dev.index));
      end.synchronize();
      if (s < warmup) continue;
      step_ms.push_back(start.elapsed_time(end));
      bwd_ms.push_back(start.elapsed_time(bwd_end));
      tail_ms.push_back(bwd_end.elapsed_time(reduced));
      if (ddp && !ddp->last_launch_events().empty()) first_launch_ms.push_back(start.elapsed_time(*ddp->last_launch_events().front()));
    }
    auto median = [](std::vector<double> v) {
      if (v.empty()) return 0.0;
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double ms = median(step_ms);
    if (rank == 0) {
      std::printf("BENCH {\"name\": \"ddp_step/%s/b%lld_per_gpu/gpus%d%s\", \"impl\": \"flame\", \"ms\": %.3f, "
                  "\"images_per_s\": %.1f, \"gpus\": %d, \"buckets\": %zu}\n",
                  preset.c_str(), static_cast<long long>(batch), world,
                  (std::string(graph ? "/graph" : "") + (reduce && ddp ? "/bf16reduce" : "")).c_str(), ms,
                  static_cast<double>(batch * world) / (ms / 1000.0), world, buckets);
      if (ddp && !graph)
        std::printf("OVERLAP flame %s gpus%d: first bucket launched %.2f ms into the step, backward ends at %.2f ms, "
                    "last all-reduce done %.2f ms after backward (medians over %d steps)\n",
                    preset.c_str(), world, median(first_launch_ms), median(bwd_ms), median(tail_ms), steps);
    }
    finish_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dist_bench: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
