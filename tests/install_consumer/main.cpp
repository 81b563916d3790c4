// An outside project using the installed FLAME through find_package(flame).
#include <flame/data.h>
#include <flame/flame.h>

#include <cmath>
#include <cstdio>
using namespace flame;

int main() {
  auto dev = Device::cpu();
  Tensor a = Tensor::randn({32, 64}, 0.0, 1.0, dev);
  Tensor b = Tensor::ones({32, 64}, dev);
  Tensor c = a.add(b).relu();
  Tensor c2 = a + b;
  Tensor d = a.matmul(b.transpose(0, 1));
  float s = c.sum_all().item<float>();
  std::vector<float> v = d.to_vec<float>();
  Tensor x = Tensor::from_vec(std::vector<float>{2, 3}, {2}, dev);
  // Check the values: d[i][j] = sum_k a[i][k]; s = sum(relu(a + 1)).
  std::vector<float> av = a.to_vec<float>();
  double want_s = 0, want_d0 = 0;
  for (int k = 0; k < 64; ++k) want_d0 += av[k];
  for (float e : av) want_s += std::max(0.0, e + 1.0);
  const bool ok = d.sizes() == Shape{32, 32} && std::fabs(v[0] - want_d0) < 1e-3 &&
                  std::fabs(s - want_s) < 1e-2 * std::max(1.0, std::fabs(want_s)) &&
                  c2.sub(c).abs().sum_all().item<float>() >= 0 && x.to_vec<float>()[1] == 3.0f;
  // flame::data (zlib is linked inside the library): an IDX array through gzip and back, and a
  // DataLoader (a header template) over a TensorDataset.
  const std::vector<uint8_t> bytes = {1, 2, 3, 4, 5, 6};
  const std::vector<uint8_t> z = data::gzip(data::encode_idx({2, 3}, bytes));
  const std::vector<uint8_t> raw = data::decode_idx_container(z, "consumer");
  const data::IdxArray arr = data::parse_idx(raw.data(), raw.size(), "consumer");
  data::DataLoader loader(std::make_shared<data::TensorDataset>(Tensor::arange(int64_t{6}).reshape({3, 2})),
                          {.batch_size = 2});
  const data::Example first = loader.next();
  const bool data_ok = arr.dims == std::vector<int64_t>{2, 3} && arr.data == bytes &&
                       first.data.to_vec<int64_t>() == std::vector<int64_t>{0, 1, 2, 3};
  std::printf("consumer: sum=%f d00=%f %s, data %s\n", s, v[0], ok ? "OK" : "MISMATCH", data_ok ? "OK" : "MISMATCH");
  return ok && data_ok ? 0 : 1;
}
