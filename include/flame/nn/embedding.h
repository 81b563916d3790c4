#pragma once
// Embedding: a lookup table [num_embeddings, embedding_dim], as torch.nn.Embedding.
#include <cstdint>
#include <optional>
#include <string>

#include "flame/nn/args.h"
#include "flame/nn/module.h"
#include "flame/random.h"

namespace flame::nn {

namespace functional {
// input: integer indices of any shape -> [..., dim]. With padding_idx, the output at that index
// still reads the row, but no gradient reaches the row (as F.embedding).
Tensor embedding(const Tensor& input, const Tensor& weight, std::optional<int64_t> padding_idx = std::nullopt);
}  // namespace functional

class Embedding : public Module {
 public:
  // weight ~ N(0, 1), the padding row zeroed (PyTorch's default); a negative padding_idx counts
  // from the end.
  Embedding(int64_t num_embeddings, int64_t embedding_dim, std::optional<int64_t> padding_idx = std::nullopt,
            TensorOptions opts = {});
  std::string name() const override { return "Embedding"; }
  FLAME_NN_ARGS_CHECK(Embedding, "nn::Embedding(num_embeddings, embedding_dim, padding_idx = nullopt, opts = {})", 2,
                      int64_t, int64_t, std::optional<int64_t>, TensorOptions)
  std::string extra_repr() const override;
  Tensor forward(const Tensor& input) override;
  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t embedding_dim() const { return embedding_dim_; }
  std::optional<int64_t> padding_idx() const { return padding_idx_; }
  const Tensor& weight() const { return weight_; }

 private:
  int64_t num_embeddings_, embedding_dim_;
  std::optional<int64_t> padding_idx_;
  Tensor weight_;
};

}  // namespace flame::nn
