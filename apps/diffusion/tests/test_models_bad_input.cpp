// Bad input to the model library's loaders and readers: files whose keys have the right names but
// degenerate shapes (a 0-length or 1-d tensor where a matrix is read), config.json files with zero
// or negative sizes, tokenizer vocabularies with ids outside the vocabulary. Each must raise one
// flame::Error naming the file (and the key or setting), never crash or read out of bounds.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include <flame/flame.h>
#include <flame/io/safetensors.h>

#include "model_test_util.h"
#include "models/flux.h"
#include "models/sd3.h"
#include "models/text_checkpoint.h"
#include "models/tokenizer_clip.h"

namespace fs = std::filesystem;
namespace m = flame_diffusion::models;
using flame::Tensor;
using fd_test::error_of;

namespace {

// The message of whatever `fn` throws (a non-flame exception is a failure: it names nothing).
template <class F>
std::string flame_error_of(F&& fn) {
  try {
    return error_of(std::forward<F>(fn));
  } catch (const std::exception& e) {
    ADD_FAILURE() << "raised a " << typeid(e).name() << " instead of flame::Error: " << e.what();
    return e.what();
  }
}

void expect_parts(const std::string& err, const std::vector<std::string>& parts) {
  EXPECT_FALSE(err.empty()) << "no error raised";
  for (const std::string& p : parts) EXPECT_NE(err.find(p), std::string::npos) << p << " in: " << err;
}

std::string save(const fs::path& dir, const std::string& name, const flame::StateDict& sd) {
  const std::string p = (dir / name).string();
  flame::io::save_safetensors(p, sd);
  return p;
}

// The keys the T5 loader reads its configuration from, at a tiny size, with `table` as block 0's
// relative attention bias.
flame::StateDict t5_shape_keys(const flame::Shape& table, const flame::Shape& shared = {40, 16}) {
  return {{"shared.weight", Tensor::zeros(shared)},
          {"encoder.block.0.layer.0.SelfAttention.q.weight", Tensor::zeros({16, 16})},
          {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", Tensor::zeros(table)},
          {"encoder.block.0.layer.1.DenseReluDense.wi_0.weight", Tensor::zeros({24, 16})}};
}

}  // namespace

TEST(ModelsBadInput, T5ShapesWithoutHeadsOrBuckets) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "t5");
  const std::string bias = "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight";
  // A bias table of 0 heads: d_kv would be q's rows / 0.
  std::string file = save(tmp, "t5_no_heads.safetensors", t5_shape_keys({32, 0}));
  expect_parts(flame_error_of([&] { m::inspect_t5_encoder(m::Checkpoint::open(file)); }),
               {"t5_no_heads.safetensors", bias, "[32, 0]"});
  // 2 buckets: the logarithmic buckets divide by num_buckets / 4 = 0.
  file = save(tmp, "t5_two_buckets.safetensors", t5_shape_keys({2, 4}));
  expect_parts(flame_error_of([&] { m::inspect_t5_encoder(m::Checkpoint::open(file)); }),
               {"t5_two_buckets.safetensors", bias, "[2, 4]"});
  // A 1-d embedding table.
  file = save(tmp, "t5_flat_shared.safetensors", t5_shape_keys({32, 4}, {40}));
  expect_parts(flame_error_of([&] { m::inspect_t5_encoder(m::Checkpoint::open(file)); }),
               {"t5_flat_shared.safetensors", "shared.weight", "[40]"});
  fs::remove_all(tmp);
}

TEST(ModelsBadInput, ClipShapesOfTheWrongRank) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "clip");
  const flame::StateDict sd{{"text_model.embeddings.token_embedding.weight", Tensor::zeros({50})},
                            {"text_model.embeddings.position_embedding.weight", Tensor::zeros({10, 16})},
                            {"text_model.encoder.layers.0.self_attn.q_proj.weight", Tensor::zeros({16, 16})},
                            {"text_model.encoder.layers.0.mlp.fc1.weight", Tensor::zeros({24, 16})}};
  const std::string file = save(tmp, "clip_flat_tokens.safetensors", sd);
  expect_parts(flame_error_of([&] { m::inspect_clip_text(m::Checkpoint::open(file)); }),
               {"clip_flat_tokens.safetensors", "text_model.embeddings.token_embedding.weight", "[50]"});
  fs::remove_all(tmp);
}

TEST(ModelsBadInput, TextConfigJsonWithNonPositiveSizes) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "text_config");
  fd_test::write_text(tmp / "clip.json",
                      "{\"hidden_size\": 16, \"num_attention_heads\": 4, \"vocab_size\": -5, \"hidden_act\": \"gelu\"}");
  expect_parts(flame_error_of([&] { m::ClipTextConfig::from_json(m::JsonConfig::from_file((tmp / "clip.json").string())); }),
               {"clip.json", "vocab_size", "-5"});
  fd_test::write_text(tmp / "clip_mlp.json", "{\"hidden_size\": 16, \"num_attention_heads\": 4, \"intermediate_size\": 0}");
  expect_parts(
      flame_error_of([&] { m::ClipTextConfig::from_json(m::JsonConfig::from_file((tmp / "clip_mlp.json").string())); }),
      {"clip_mlp.json", "intermediate_size", "0"});
  fd_test::write_text(tmp / "t5.json", "{\"d_model\": 16, \"d_kv\": 4, \"num_heads\": 4, \"d_ff\": -1}");
  expect_parts(flame_error_of([&] { m::T5EncoderConfig::from_json(m::JsonConfig::from_file((tmp / "t5.json").string())); }),
               {"t5.json", "d_ff", "-1"});
  fd_test::write_text(tmp / "t5_heads.json", "{\"d_model\": 16, \"d_kv\": 4, \"num_heads\": 0}");
  expect_parts(
      flame_error_of([&] { m::T5EncoderConfig::from_json(m::JsonConfig::from_file((tmp / "t5_heads.json").string())); }),
      {"t5_heads.json", "num_heads", "0"});
  fs::remove_all(tmp);
}

TEST(ModelsBadInput, FluxShapesWithAZeroHeadDim) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "flux");
  const flame::StateDict sd{{"x_embedder.weight", Tensor::zeros({256, 64})},
                            {"context_embedder.weight", Tensor::zeros({256, 32})},
                            {"time_text_embed.timestep_embedder.linear_1.weight", Tensor::zeros({256, 256})},
                            {"time_text_embed.text_embedder.linear_1.weight", Tensor::zeros({256, 24})},
                            {"transformer_blocks.0.attn.norm_q.weight", Tensor::zeros({0})},
                            {"proj_out.weight", Tensor::zeros({64, 256})}};
  const std::string file = save(tmp, "flux_zero_head.safetensors", sd);
  expect_parts(flame_error_of([&] { m::inspect_flux(m::Checkpoint::open(file)); }),
               {"flux_zero_head.safetensors", "transformer_blocks.0.attn.norm_q.weight", "[0]"});
  // A 1-d input projection.
  flame::StateDict flat;
  for (const auto& [name, t] : sd) flat.insert(name, name == "x_embedder.weight" ? Tensor::zeros({256}) : t);
  const std::string file2 = save(tmp, "flux_flat_in.safetensors", flat);
  expect_parts(flame_error_of([&] { m::inspect_flux(m::Checkpoint::open(file2)); }),
               {"flux_flat_in.safetensors", "x_embedder.weight", "[256]"});
  fs::remove_all(tmp);
}

// A stray block index (double_blocks.99999999.*) must not make a model that deep: block indices
// are numbered without gaps.
TEST(ModelsBadInput, FluxBlockIndicesWithAGap) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "flux_gap");
  const flame::StateDict sd{{"x_embedder.weight", Tensor::zeros({256, 64})},
                            {"context_embedder.weight", Tensor::zeros({256, 32})},
                            {"time_text_embed.timestep_embedder.linear_1.weight", Tensor::zeros({256, 256})},
                            {"time_text_embed.text_embedder.linear_1.weight", Tensor::zeros({256, 24})},
                            {"transformer_blocks.0.attn.norm_q.weight", Tensor::zeros({128})},
                            {"transformer_blocks.99999999.attn.norm_q.weight", Tensor::zeros({128})},
                            {"proj_out.weight", Tensor::zeros({64, 256})}};
  const std::string file = save(tmp, "flux_gap.safetensors", sd);
  expect_parts(flame_error_of([&] { m::inspect_flux(m::Checkpoint::open(file)); }),
               {"flux_gap.safetensors", "transformer_blocks.", "2 blocks", "99999999", "without gaps"});
  fs::remove_all(tmp);
}

TEST(ModelsBadInput, SD3ShapesWithAZeroPatch) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "sd3");
  const flame::StateDict sd{{"context_embedder.weight", Tensor::zeros({64, 32})},
                            {"x_embedder.proj.weight", Tensor::zeros({64, 16, 0, 0})},
                            {"pos_embed", Tensor::zeros({1, 16, 64})},
                            {"y_embedder.mlp.0.weight", Tensor::zeros({64, 24})},
                            {"final_layer.linear.weight", Tensor::zeros({64, 64})},
                            {"joint_blocks.0.x_block.attn.qkv.weight", Tensor::zeros({192, 64})}};
  const std::string file = save(tmp, "sd3_zero_patch.safetensors", sd);
  expect_parts(flame_error_of([&] { m::inspect_sd3(m::Checkpoint::open(file)); }),
               {"sd3_zero_patch.safetensors", "x_embedder.proj.weight", "[64, 16, 0, 0]"});
  fs::remove_all(tmp);
}

TEST(ModelsBadInput, ClipVocabularyIdsOutsideTheVocabulary) {
  const fs::path tmp = fd_test::fresh_temp_dir("flame_bad_input", "clip_vocab");
  fd_test::write_text(tmp / "merges.txt", "#version: 0.2\na b\n");
  // A dense vocabulary of 4 ids but BOS stored as -3 (or far outside): every encoded caption starts
  // with an id no embedding table has.
  for (const std::string id : {"-3", "1000000"}) {
    fd_test::write_text(tmp / "vocab.json", "{\"a\": 0, \"b\": 1, \"<|startoftext|>\": " + id +
                                                ", \"<|endoftext|>\": 3}");
    expect_parts(flame_error_of([&] {
                   m::ClipTokenizer::from_files((tmp / "vocab.json").string(), (tmp / "merges.txt").string());
                 }),
                 {"vocab.json", "<|startoftext|>", id});
  }
  fs::remove_all(tmp);
}
