// Safetensors I/O (include/flame/io/safetensors.h): round trips of every dtype and layout on the
// device under test, the exact byte layout of the reference writer, lazy access, dtype handling,
// and a table of corrupt files each refused with an error naming the problem and the file.
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <sys/stat.h>
#include <vector>

#include "flame/io.h"
#include "test_util.h"

namespace flame::test {
namespace {

// A fresh path per call: tests may run in parallel processes (ctest shards) and threads.
std::string temp_path(const std::string& stem) {
  static std::atomic<int> counter{0};
  std::string dir = ::testing::TempDir();
  if (!dir.empty() && dir.back() != '/') dir += '/';
  return dir + "flame_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" + stem +
         ".safetensors";
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(f.good()) << path;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

// A file from a header text (padded with spaces to a multiple of 8) and raw data bytes.
std::string file_of(std::string header, const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  return le64(header.size()) + header + data;
}

// The raw bytes of a tensor's elements in row-major order (from any device and layout).
std::string bytes_of(const Tensor& t) {
  const Tensor h = t.detach().contiguous().to(Device::cpu());
  return std::string(static_cast<const char*>(h.data_ptr()), h.nbytes());
}

template <class T>
std::string bytes_of_vec(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// Random values of any dtype (never all zeros), drawn on the CPU and moved to `device`.
Tensor random_tensor(const Shape& shape, DType dt, Device device, uint64_t seed) {
  Generator gen(seed);
  Tensor t;
  if (is_floating(dt)) {
    t = Tensor::randn(shape, 0.0, 3.0, {DType::f64}, &gen).to(dt);
  } else if (dt == DType::boolean) {
    t = Tensor::rand(shape, {}, &gen).lt(Tensor::scalar(0.5));
  } else if (dt == DType::u8) {
    t = Tensor::randint(0, 256, shape, {DType::u8}, &gen);
  } else {
    t = Tensor::randint(-1000000, 1000000, shape, {dt}, &gen);
  }
  return t.to(device);
}

// ---- dtype names ----

TEST(SafetensorsDType, NamesRoundTrip) {
  for (DType t : kAllDTypes) {
    const std::optional<DType> back = io::dtype_from_safetensors(io::safetensors_dtype(t));
    ASSERT_TRUE(back.has_value()) << dtype_name(t);
    EXPECT_EQ(*back, t) << dtype_name(t);
  }
  EXPECT_STREQ(io::safetensors_dtype(DType::bf16), "BF16");
  EXPECT_STREQ(io::safetensors_dtype(DType::boolean), "BOOL");
  EXPECT_STREQ(io::safetensors_dtype(DType::f64), "F64");
  EXPECT_STREQ(io::safetensors_dtype(DType::u8), "U8");
  EXPECT_STREQ(io::safetensors_dtype(DType::f8_e4m3fn), "F8_E4M3");
  EXPECT_EQ(io::dtype_from_safetensors("F8_E5M2"), DType::f8_e5m2);
  for (const char* foreign : {"I8", "I16", "U16", "U32", "U64", "F8_E8M0", "C64"}) {
    EXPECT_FALSE(io::dtype_from_safetensors(foreign).has_value()) << foreign;
  }
  expect_error([] { (void)io::dtype_from_safetensors("F17"); }, {"safetensors", "unknown dtype", "F17"});
  expect_error([] { (void)io::dtype_from_safetensors("f32"); }, {"unknown dtype", "f32"});
}

// ---- round trips ----

TEST(SafetensorsRoundTrip, EveryDTypeAndLayoutBitExact) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Device dev = test_device();
  StateDict sd;
  uint64_t seed = 11;
  for (DType dt : kAllDTypes) {
    const std::string d = dtype_name(dt);
    sd.insert(d + ".odd", random_tensor({3, 5, 7}, dt, dev, seed++));
    sd.insert(d + ".scalar", random_tensor({}, dt, dev, seed++));
    sd.insert(d + ".empty", random_tensor({0, 4}, dt, dev, seed++));
    sd.insert(d + ".transposed", random_tensor({6, 9}, dt, dev, seed++).t());
    sd.insert(d + ".strided", random_tensor({5, 12}, dt, dev, seed++).slice(1, 1, 12, 3));
    sd.insert(d + ".expanded", random_tensor({1, 3}, dt, dev, seed++).expand({4, 3}));
  }
  const io::Metadata meta{{"format", "pt"}, {"epoch", "12"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}};
  const std::string path = temp_path("every_dtype");
  io::save_safetensors(path, sd, meta);

  const StateDict back = io::load_safetensors(path, dev);
  ASSERT_EQ(back.keys(), sd.keys());  // the dict's order survives
  for (const auto& [name, t] : sd) {
    const Tensor& b = back.at(name);
    EXPECT_EQ(b.dtype(), t.dtype()) << name;
    EXPECT_EQ(b.sizes(), t.sizes()) << name;
    EXPECT_EQ(b.device(), dev) << name;
    EXPECT_TRUE(b.is_contiguous()) << name;
    EXPECT_EQ(bytes_of(b), bytes_of(t)) << name;
  }
  EXPECT_EQ(io::load_safetensors_metadata(path), meta);
  std::remove(path.c_str());
}

TEST(SafetensorsRoundTrip, LoadedTensorsAreFreshLeaves) {
  FLAME_SKIP_IF_NO_DEVICE();
  Tensor w = random_tensor({4, 3}, DType::f32, test_device(), 3).requires_grad_();
  StateDict sd{{"w", w}, {"w2", w.mul_scalar(2.0)}};
  const std::string path = temp_path("leaves");
  io::save_safetensors(path, sd);
  const StateDict back = io::load_safetensors(path, test_device());
  EXPECT_FALSE(back.at("w").requires_grad());
  EXPECT_TRUE(back.at("w").is_leaf());
  EXPECT_FALSE(back.at("w").shares_storage(w));
  EXPECT_EQ(bytes_of(back.at("w2")), bytes_of(w.mul_scalar(2.0)));
  std::remove(path.c_str());
}

// The bytes match what the reference writer produces for the same dict: compact JSON with
// "__metadata__" first, space padding to 8, data by decreasing element size.
TEST(SafetensorsRoundTrip, FileLayoutMatchesReferenceWriter) {
  const Tensor h = Tensor::from_vec(std::vector<float>{1.5f, -2.0f, 3.25f}, {3}).to(DType::f16);
  const Tensor f = Tensor::from_vec(std::vector<float>{0.5f, -7.0f}, {2, 1});
  const Tensor b = Tensor::from_vec(std::vector<bool>{true, false}, {2});
  const std::string path = temp_path("layout");
  io::save_safetensors(path, StateDict{{"half", h}, {"b", b}, {"f", f}}, {{"format", "pt"}});
  const std::string want_header =
      R"({"__metadata__":{"format":"pt"},"half":{"dtype":"F16","shape":[3],"data_offsets":[8,14]},)"
      R"("b":{"dtype":"BOOL","shape":[2],"data_offsets":[14,16]},)"
      R"("f":{"dtype":"F32","shape":[2,1],"data_offsets":[0,8]}})";
  const std::string want = file_of(want_header, bytes_of(f) + bytes_of(h) + bytes_of(b));
  const std::string got = read_file(path);
  EXPECT_EQ(got.size() % 8, 0u);  // header padding 8-aligned, here the data is too
  EXPECT_EQ(got, want);
  EXPECT_EQ(bytes_of(b), std::string("\x01\x00", 2));
  std::remove(path.c_str());
}

TEST(SafetensorsRoundTrip, OverwritesAndLeavesNoTemporary) {
  const std::string path = temp_path("overwrite");
  io::save_safetensors(path, StateDict{{"a", Tensor::ones({100})}});
  io::save_safetensors(path, StateDict{{"b", Tensor::full({2}, 3.0)}});
  const StateDict back = io::load_safetensors(path);
  EXPECT_EQ(back.keys(), std::vector<std::string>{"b"});
  EXPECT_EQ(back.at("b").to_vec<float>(), (std::vector<float>{3.0f, 3.0f}));
  EXPECT_FALSE(file_exists(path + ".tmp" + std::to_string(::getpid())));
  std::remove(path.c_str());
}

// ---- reading files written by hand (independent of the writer) ----

TEST(SafetensorsLoad, HandWrittenFile) {
  FLAME_SKIP_IF_NO_DEVICE();
  const std::vector<int64_t> ids{-5, 1LL << 40, 7};
  const std::vector<float> w{0.25f, -1.0f, 3.5f, 1e-3f, 8.0f, -0.0f};
  const std::vector<uint8_t> mask{1, 0, 1, 1};
  // Entries out of offset order in the JSON, extra whitespace, an unknown extra field (ignored
  // by the reference too), and an empty tensor sharing an offset.
  const std::string header =
      "  {\"w\": {\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[24,48], \"extra\": 1},\n"
      "\"ids\":{\"dtype\":\"I64\",\"shape\":[3],\"data_offsets\":[0,24]},"
      "\"none\":{\"dtype\":\"F16\",\"shape\":[0,5],\"data_offsets\":[48,48]},"
      "\"__metadata__\":{\"k\":\"v\"},"
      "\"mask\":{\"dtype\":\"BOOL\",\"shape\":[2,2],\"data_offsets\":[48,52]}}";
  const std::string path = temp_path("hand");
  write_file(path, file_of(header, bytes_of_vec(ids) + bytes_of_vec(w) + bytes_of_vec(mask)));
  const StateDict sd = io::load_safetensors(path, test_device());
  EXPECT_EQ(sd.keys(), (std::vector<std::string>{"w", "ids", "none", "mask"}));
  EXPECT_EQ(sd.at("ids").to_vec<int64_t>(), ids);
  EXPECT_EQ(sd.at("w").sizes(), (Shape{2, 3}));
  EXPECT_EQ(bytes_of(sd.at("w")), bytes_of_vec(w));
  EXPECT_EQ(sd.at("none").sizes(), (Shape{0, 5}));
  EXPECT_EQ(sd.at("none").dtype(), DType::f16);
  EXPECT_EQ(sd.at("mask").dtype(), DType::boolean);
  EXPECT_EQ(sd.at("mask").to_vec<bool>(), (std::vector<bool>{true, false, true, true}));
  EXPECT_EQ(io::load_safetensors_metadata(path), (io::Metadata{{"k", "v"}}));
  std::remove(path.c_str());
}

TEST(SafetensorsFile, LazyAccess) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor a = random_tensor({4, 5}, DType::f32, Device::cpu(), 21);
  const Tensor c = random_tensor({3}, DType::i64, Device::cpu(), 22);
  const std::string path = temp_path("lazy");
  io::save_safetensors(path, StateDict{{"a", a}, {"c", c}}, {{"who", "test"}});

  const io::SafetensorsFile file(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "c"}));
  EXPECT_TRUE(file.contains("c"));
  EXPECT_FALSE(file.contains("b"));
  EXPECT_EQ(file.metadata().at("who"), "test");
  const io::TensorInfo& ia = file.info("a");
  EXPECT_EQ(ia.dtype, "F32");
  EXPECT_TRUE(ia.flame_dtype == DType::f32);
  EXPECT_EQ(ia.shape, (Shape{4, 5}));
  EXPECT_EQ(ia.nbytes, 80u);
  const io::TensorInfo& ic = file.info("c");
  EXPECT_EQ(ic.nbytes, 24u);
  // c (8-byte elements) is laid out first; offsets are absolute and the data ends the file.
  EXPECT_EQ(ia.offset, ic.offset + 24);
  EXPECT_EQ(ia.offset + ia.nbytes, file.file_size());
  EXPECT_EQ(read_file(path).substr(ia.offset, ia.nbytes), bytes_of(a));
  expect_error([&] { (void)file.info("b"); }, {"safetensors", path, "no tensor", "\"b\""});
  expect_error([&] { (void)file.load("zz"); }, {path, "\"zz\""});

  // One tensor, to the device, converted (any dtype on a single load).
  const Tensor got = file.load("a", test_device(), DType::bf16);
  EXPECT_EQ(got.dtype(), DType::bf16);
  EXPECT_EQ(got.device(), test_device());
  EXPECT_EQ(bytes_of(got), bytes_of(a.to(DType::bf16)));
  EXPECT_EQ(file.load("c", test_device(), DType::f64).to_vec<double>(), c.to_vec<double>());

  // Tensors outlive the file object (the mapping goes with the last copy).
  Tensor kept;
  {
    io::SafetensorsFile copy = file;
    kept = copy.load("a");
  }
  EXPECT_EQ(bytes_of(kept), bytes_of(a));
  std::remove(path.c_str());
}

TEST(SafetensorsLoad, DTypeOptionConvertsFloatingTensorsOnly) {
  FLAME_SKIP_IF_NO_DEVICE();
  const Tensor w = random_tensor({7, 3}, DType::f32, Device::cpu(), 31);
  const Tensor h = random_tensor({5}, DType::f16, Device::cpu(), 32);
  const Tensor n = random_tensor({2}, DType::i64, Device::cpu(), 33);
  const Tensor m = random_tensor({4}, DType::boolean, Device::cpu(), 34);
  const std::string path = temp_path("convert");
  io::save_safetensors(path, StateDict{{"w", w}, {"h", h}, {"n", n}, {"m", m}});
  const StateDict sd = io::load_safetensors(path, test_device(), DType::bf16);
  EXPECT_EQ(sd.at("w").dtype(), DType::bf16);
  EXPECT_EQ(bytes_of(sd.at("w")), bytes_of(w.to(DType::bf16)));
  EXPECT_EQ(bytes_of(sd.at("h")), bytes_of(h.to(DType::bf16)));
  EXPECT_EQ(sd.at("n").dtype(), DType::i64);
  EXPECT_EQ(bytes_of(sd.at("n")), bytes_of(n));
  EXPECT_EQ(sd.at("m").dtype(), DType::boolean);
  EXPECT_EQ(bytes_of(sd.at("m")), bytes_of(m));
  std::remove(path.c_str());
}

TEST(SafetensorsLoad, ForeignDTypeListedButRefusedByName) {
  const std::string header =
      R"({"q":{"dtype":"I8","shape":[4],"data_offsets":[0,4]},)"
      R"("w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})";
  const float one = 1.0f;
  const std::string path = temp_path("foreign");
  write_file(path, file_of(header, std::string("\x01\xff\x02\x80", 4) +
                                       std::string(reinterpret_cast<const char*>(&one), 4)));
  const io::SafetensorsFile file(path);
  EXPECT_EQ(file.info("q").dtype, "I8");
  EXPECT_FALSE(file.info("q").flame_dtype.has_value());
  EXPECT_EQ(file.load("w").item<float>(), 1.0f);
  expect_error([&] { (void)file.load("q"); }, {"safetensors", path, "\"q\"", "I8", "FLAME does not have"});
  expect_error([&] { (void)io::load_safetensors(path); }, {"\"q\"", "I8"});
  std::remove(path.c_str());
}

TEST(SafetensorsLoad, Float8EveryBitPatternDecodes) {
  FLAME_SKIP_IF_NO_DEVICE();
  std::string all(256, '\0');
  for (int i = 0; i < 256; ++i) all[i] = static_cast<char>(i);
  const std::string header =
      R"({"e4m3":{"dtype":"F8_E4M3","shape":[16,16],"data_offsets":[0,256]},)"
      R"("e5m2":{"dtype":"F8_E5M2","shape":[256],"data_offsets":[256,512]}})";
  const std::string path = temp_path("f8");
  write_file(path, file_of(header, all + all));
  const io::SafetensorsFile file(path);
  EXPECT_EQ(file.info("e4m3").dtype, "F8_E4M3");
  EXPECT_EQ(file.info("e4m3").flame_dtype, DType::f8_e4m3fn);
  const Tensor a = file.load("e4m3", test_device()), b = file.load("e5m2", test_device());
  EXPECT_EQ(a.dtype(), DType::f32);
  EXPECT_EQ(a.sizes(), (Shape{16, 16}));
  const std::vector<float> av = a.to_vec<float>(), bv = b.to_vec<float>();
  int nan4 = 0, nan5 = 0;
  for (int i = 0; i < 256; ++i) {
    const float ra = f8_reference(static_cast<uint8_t>(i), 4, 3), rb = f8_reference(static_cast<uint8_t>(i), 5, 2);
    if (std::isnan(ra)) {
      ++nan4;
      EXPECT_TRUE(std::isnan(av[i])) << "e4m3 byte " << i;
    } else {
      EXPECT_EQ(bytes_of_vec(std::vector<float>{av[i]}), bytes_of_vec(std::vector<float>{ra})) << "e4m3 byte " << i;
    }
    if (std::isnan(rb)) {
      ++nan5;
      EXPECT_TRUE(std::isnan(bv[i])) << "e5m2 byte " << i;
    } else {
      EXPECT_EQ(bytes_of_vec(std::vector<float>{bv[i]}), bytes_of_vec(std::vector<float>{rb})) << "e5m2 byte " << i;
    }
  }
  EXPECT_EQ(nan4, 2);  // 0x7f and 0xff
  EXPECT_EQ(nan5, 6);  // exponent 31 with mantissa 1..3, both signs
  // Anchors of the formats' tables.
  EXPECT_EQ(av[0x38], 1.0f);
  EXPECT_EQ(av[0x7e], 448.0f);
  EXPECT_EQ(av[0xfe], -448.0f);
  EXPECT_EQ(av[0x01], std::ldexp(1.0f, -9));
  EXPECT_EQ(av[0x08], std::ldexp(1.0f, -6));
  EXPECT_TRUE(std::signbit(av[0x80]) && av[0x80] == 0.0f);
  EXPECT_EQ(bv[0x3c], 1.0f);
  EXPECT_EQ(bv[0x7b], 57344.0f);
  EXPECT_EQ(bv[0x7c], std::numeric_limits<float>::infinity());
  EXPECT_EQ(bv[0xfc], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(bv[0x01], std::ldexp(1.0f, -16));
  // A dtype asks for the conversion (every E4M3 value is exact in bf16: 3 mantissa bits, exponents
  // within bf16's range); load_all converts F8 tensors too; integer dtypes are refused by name.
  const Tensor h = file.load("e4m3", test_device(), DType::bf16);
  EXPECT_EQ(h.dtype(), DType::bf16);
  const std::vector<float> hv = h.to(DType::f32).to_vec<float>();
  for (int i = 0; i < 256; ++i)
    if (!std::isnan(av[i])) EXPECT_EQ(hv[i], av[i]) << i;
  const StateDict sd = io::load_safetensors(path, test_device(), DType::f16);
  EXPECT_EQ(sd.at("e5m2").dtype(), DType::f16);
  EXPECT_EQ(sd.at("e5m2").to(DType::f32).to_vec<float>()[0x3c], 1.0f);
  expect_error([&] { (void)file.load("e4m3", Device::cpu(), DType::i32); }, {"safetensors", path, "\"e4m3\"", "F8_E4M3"});
  // Asked for as its own dtype, a F8 tensor keeps its codes (Note [Float8 dtypes]); saved again it
  // writes the same bytes under the same dtype. The other 8-bit dtype converts through the values.
  const Tensor k = file.load("e4m3", test_device(), DType::f8_e4m3fn);
  EXPECT_EQ(k.dtype(), DType::f8_e4m3fn);
  const std::vector<float> kv = k.to(DType::f32).to_vec<float>();
  for (int i = 0; i < 256; ++i) {
    if (std::isnan(av[i])) EXPECT_TRUE(std::isnan(kv[i])) << i;
    else EXPECT_EQ(bytes_of_vec(std::vector<float>{kv[i]}), bytes_of_vec(std::vector<float>{av[i]})) << i;
  }
  const std::string again = temp_path("f8_again");
  StateDict out;
  out.insert("e4m3", k);
  out.insert("e5m2", file.load("e5m2", test_device(), DType::f8_e5m2));
  io::save_safetensors(again, out);
  const io::SafetensorsFile back(again);
  EXPECT_EQ(back.info("e4m3").dtype, "F8_E4M3");
  EXPECT_EQ(back.info("e5m2").dtype, "F8_E5M2");
  EXPECT_EQ(read_file(again).substr(back.info("e4m3").offset, 256), all);
  EXPECT_EQ(read_file(again).substr(back.info("e5m2").offset, 256), all);
  EXPECT_EQ(file.load("e4m3", test_device(), DType::f8_e5m2).dtype(), DType::f8_e5m2);
  EXPECT_EQ(io::load_safetensors(path, test_device(), DType::f8_e5m2).at("e4m3").dtype(), DType::f8_e5m2);
  std::remove(again.c_str());
  std::remove(path.c_str());
}

TEST(SafetensorsLoad, BoolBytesMustBeZeroOrOne) {
  const std::string path = temp_path("bool");
  write_file(path, file_of(R"({"m":{"dtype":"BOOL","shape":[3],"data_offsets":[0,3]}})",
                           std::string("\x01\x00\x02", 3)));
  expect_error([&] { (void)io::load_safetensors(path); },
               {"safetensors", path, "BOOL", "\"m\"", "byte 2", "element 2"});
  std::remove(path.c_str());
}

// ---- saving errors ----

TEST(SafetensorsSave, Errors) {
  const std::string path = temp_path("save_errors");
  const Tensor t = Tensor::ones({2});
  expect_error([&] { io::save_safetensors(path, StateDict{{"x", Tensor()}}); },
               {"save_safetensors", "\"x\"", "undefined"});
  expect_error([&] { io::save_safetensors(path, StateDict{{"__metadata__", t}}); },
               {"safetensors", "__metadata__"});
  expect_error([&] { io::save_safetensors(path, StateDict{{std::string("bad\xff", 4), t}}); },
               {"safetensors", path, "UTF-8"});
  expect_error([&] { io::save_safetensors(path, StateDict{{"a", t}}, {{"k", std::string("\xc3", 1)}}); },
               {"UTF-8"});
  EXPECT_FALSE(file_exists(path));  // nothing was written
  const std::string nodir = ::testing::TempDir() + "/flame_no_such_dir_" + std::to_string(::getpid()) +
                            "/x.safetensors";
  expect_error([&] { io::save_safetensors(nodir, StateDict{{"a", t}}); },
               {"save_safetensors", "cannot open", "flame_no_such_dir_"});

  // A failed save leaves an existing file as it was.
  io::save_safetensors(path, StateDict{{"a", t}});
  const std::string before = read_file(path);
  expect_error([&] { io::save_safetensors(path, StateDict{{"a", t}, {"b", Tensor()}}); }, {"\"b\""});
  EXPECT_EQ(read_file(path), before);
  std::remove(path.c_str());
}

// ---- corrupt files ----

struct CorruptCase {
  const char* what;
  std::string bytes;
  std::vector<std::string> expect;  // parts of the error message (besides the path)
};

std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets +
         "}";
}

std::vector<CorruptCase> corrupt_cases() {
  const std::string d8(8, '\x11'), d16(16, '\x22');
  const std::string a = entry("a", "F32", "[2]", "[0,8]");
  std::string deep;
  for (int i = 0; i < 100; ++i) deep += "[";
  for (int i = 0; i < 100; ++i) deep += "]";
  return {
      {"empty file", "", {"0 bytes", "too short"}},
      {"truncated length", std::string("\x10\x00\x00", 3), {"3 bytes", "too short"}},
      {"length past the end", le64(64) + "{}", {"header length 64", "past the end"}},
      {"huge length", le64(~uint64_t{0}) + "{}      ", {"header length 18446744073709551615", "exceeds the limit"}},
      {"length just over the cap", le64(100000001) + "{}", {"100000001", "exceeds the limit of 100000000"}},
      {"zero length", le64(0), {"not valid JSON"}},
      {"not JSON", file_of("hello", ""), {"not valid JSON"}},
      {"JSON with trailing garbage", file_of("{} x", ""), {"not valid JSON"}},
      {"invalid UTF-8", file_of("{\"a\xff\":1}", ""), {"not valid JSON"}},
      {"NUL in header", file_of(std::string("{\0}", 3), ""), {"not valid JSON"}},
      {"array header", file_of("[1,2]", ""), {"must be a JSON object", "array"}},
      {"string header", file_of("\"abc\"", ""), {"must be a JSON object", "string"}},
      {"entry not an object", file_of("{\"a\":[1]}", ""), {"entry \"a\"", "must be an object", "array"}},
      {"missing dtype", file_of(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", d8), {"\"a\"", "no \"dtype\""}},
      {"missing shape", file_of(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", d8), {"\"a\"", "no \"shape\""}},
      {"missing data_offsets", file_of(R"({"a":{"dtype":"F32","shape":[2]}})", d8), {"no \"data_offsets\""}},
      {"dtype not a string", file_of(R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8),
       {"\"dtype\" of tensor \"a\"", "must be a string", "number"}},
      {"unknown dtype", file_of("{" + entry("a", "F17", "[2]", "[0,8]") + "}", d8), {"\"a\"", "unknown dtype \"F17\""}},
      {"lowercase dtype", file_of("{" + entry("a", "f32", "[2]", "[0,8]") + "}", d8), {"unknown dtype \"f32\""}},
      {"shape not an array", file_of("{" + entry("a", "F32", "2", "[0,8]") + "}", d8), {"\"shape\"", "must be an array"}},
      {"negative shape", file_of("{" + entry("a", "F32", "[-2]", "[0,8]") + "}", d8), {"\"shape\"", "negative value -2"}},
      {"fractional shape", file_of("{" + entry("a", "F32", "[2.0]", "[0,8]") + "}", d8), {"\"shape\"", "non-negative integers", "number"}},
      {"string in shape", file_of("{" + entry("a", "F32", "[\"2\"]", "[0,8]") + "}", d8), {"\"shape\"", "string"}},
      {"dim over 2^63", file_of("{" + entry("a", "F32", "[18446744073709551615]", "[0,8]") + "}", d8), {"more than 2^63 - 1"}},
      {"dim over 2^64", file_of("{" + entry("a", "F32", "[18446744073709551616]", "[0,8]") + "}", d8), {"\"shape\"", "non-negative integers"}},
      {"shape product overflow", file_of("{" + entry("a", "F32", "[4294967296,4294967296,4]", "[0,8]") + "}", d8),
       {"\"a\"", "more bytes than 2^63 - 1"}},
      {"bytes overflow", file_of("{" + entry("a", "F64", "[2305843009213693952]", "[0,8]") + "}", d8),
       {"more bytes than 2^63 - 1"}},
      {"offsets not two", file_of("{" + entry("a", "F32", "[2]", "[0,4,8]") + "}", d8), {"array of 2 integers", "3 elements"}},
      {"offsets not an array", file_of("{" + entry("a", "F32", "[2]", "8") + "}", d8), {"array of 2 integers", "number"}},
      {"negative offset", file_of("{" + entry("a", "F32", "[2]", "[-8,0]") + "}", d8), {"data_offsets", "negative"}},
      {"offsets reversed", file_of("{" + entry("a", "F32", "[0]", "[8,0]") + "}", d8), {"[8, 0]", "end before they begin"}},
      {"size does not match shape", file_of("{" + entry("a", "F32", "[3]", "[0,8]") + "}", d8),
       {"\"a\"", "spans 8 bytes", "needs 12"}},
      {"first tensor not at 0", file_of("{" + entry("a", "F32", "[2]", "[8,16]") + "}", d16), {"gap", "[0, 8)"}},
      {"gap between tensors", file_of("{" + a + "," + entry("b", "F32", "[1]", "[12,16]") + "}", d16),
       {"gap", "[8, 12)", "\"b\""}},
      {"overlapping tensors", file_of("{" + a + "," + entry("b", "F32", "[2]", "[4,12]") + "}", d16),
       {"\"b\"", "overlaps", "\"a\""}},
      {"same offsets twice", file_of("{" + a + "," + entry("b", "F32", "[2]", "[0,8]") + "}", d8), {"overlaps"}},
      {"data too short", file_of("{" + a + "}", d8.substr(0, 5)), {"span 8 bytes", "holds 5", "truncated"}},
      {"data too long", file_of("{" + a + "}", d16), {"span 8 bytes", "holds 16", "trailing"}},
      {"duplicate name", file_of("{" + a + "," + entry("a", "F32", "[2]", "[8,16]") + "}", d16), {"duplicate key \"a\""}},
      {"duplicate field", file_of(R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", d8),
       {"duplicate key \"dtype\""}},
      {"duplicate metadata key", file_of(R"({"__metadata__":{"k":"1","k":"2"}})", ""), {"duplicate key \"k\""}},
      {"metadata value not a string", file_of(R"({"__metadata__":{"epoch":3}})", ""),
       {"\"__metadata__\" value of key \"epoch\"", "must be a string", "number"}},
      {"metadata not an object", file_of(R"({"__metadata__":["a"]})", ""), {"\"__metadata__\" must be an object", "array"}},
      {"metadata null", file_of(R"({"__metadata__":null})", ""), {"\"__metadata__\" must be an object", "null"}},
      {"nesting too deep", file_of("{\"__metadata__\":" + deep + "}", ""), {"nested more than 64"}},
  };
}

TEST(SafetensorsCorrupt, TableOfBrokenFiles) {
  const std::vector<CorruptCase> cases = corrupt_cases();
  ASSERT_GE(cases.size(), 15u);
  for (const CorruptCase& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string path = temp_path("corrupt");
    write_file(path, c.bytes);
    std::vector<std::string> parts = c.expect;
    parts.push_back("safetensors");
    parts.push_back(path);
    expect_error([&] { (void)io::SafetensorsFile(path); }, parts);
    expect_error([&] { (void)io::load_safetensors(path); }, parts);
    expect_error([&] { (void)io::load_safetensors_metadata(path); }, parts);
    std::remove(path.c_str());
  }
}

// Note [Foreign files]: a PNG, a zip (torch.save), a pickle, a text file or bytes of no known format
// given as safetensors are named as such, with their first bytes, instead of a header-length
// complaint; a file that looks like safetensors keeps the precise header message.
TEST(SafetensorsCorrupt, ForeignFilesAreNamedByTheirFirstBytes) {
  // A real PNG's first 16 bytes: signature, IHDR length 13, "IHDR". As a little-endian length the
  // signature reads 727905341920923785, over the 100 MB cap.
  const std::string png = std::string("\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR", 16) + std::string(64, '\0');
  struct Foreign {
    const char* what;
    std::string bytes;
    std::vector<std::string> expect;
  };
  const std::vector<Foreign> cases = {
      {"png", png, {"is not a safetensors file (starts with bytes 89 50 4E 47 0D 0A 1A 0A ...: a PNG image)"}},
      {"zip", std::string("PK\x03\x04\x14\x00\x00\x00\x08\x00", 10), {"bytes 50 4B 03 04 14 00 00 00 ...", "a zip archive"}},
      {"pickle", std::string("\x80\x02\x8a\x0alz\xfc\x9c" "F\xf9 j\xa8", 13), {"bytes 80 02 8A 0A 6C 7A FC 9C ...", "pickle"}},
      {"jpeg", std::string("\xff\xd8\xff\xe0\x00\x10JFIF\x00", 11), {"bytes FF D8 FF E0 00 10 4A 46 ...", "a JPEG image"}},
      {"text", std::string("step,loss,lr,grad_norm,time\n1,0.5,0.001,1,0.1\n"), {"bytes 73 74 65 70 2C 6C 6F 73 ...", ": text)"}},
      {"unknown", std::string("\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a", 10),
       {"bytes 01 02 03 04 05 06 07 08 ...: an unknown format)"}},
      {"short", std::string("\x01\x02\x03\x04\x05\x06\x07\x08", 8), {"bytes 01 02 03 04 05 06 07 08: an unknown format)"}},
  };
  for (const Foreign& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string path = temp_path(c.what);
    write_file(path, c.bytes);
    std::vector<std::string> parts = c.expect;
    parts.push_back("safetensors: '" + path + "'");
    expect_error([&] { (void)io::SafetensorsFile(path); }, parts);
    expect_error([&] { (void)io::load_safetensors_metadata(path); }, parts);
    try {
      (void)io::SafetensorsFile(path);
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find("header length"), std::string::npos) << e.what();
    }
    std::remove(path.c_str());
  }
}

// A header byte changed to a non-ASCII or control byte: the JSON parser's message quotes the text it
// read, and the message shows those bytes escaped (\xFF), never raw; so do tensor names.
TEST(SafetensorsCorrupt, MessagesEscapeRawBytes) {
  const auto raw_free = [](const std::string& m) {
    for (const char ch : m) {
      const auto b = static_cast<unsigned char>(ch);
      if (b >= 0x7f || (b < 0x20 && b != '\n')) return false;
    }
    return true;
  };
  const std::string path = temp_path("flip");
  write_file(path, file_of("{\"a\xff\x01\":1}", ""));
  try {
    (void)io::SafetensorsFile(path);
    ADD_FAILURE() << "no error for a header with a 0xFF byte";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(raw_free(m)) << m;
    EXPECT_NE(m.find("\\xFF"), std::string::npos) << m;
    EXPECT_NE(m.find("not valid JSON"), std::string::npos) << m;
  }
  write_file(path, file_of("{\"b\\u001b[31m\xc3\xa9\":[1]}", ""));  // ESC [31m and a UTF-8 e-acute
  try {
    (void)io::SafetensorsFile(path);
    ADD_FAILURE() << "no error for an entry that is not an object";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_TRUE(raw_free(m)) << m;
    EXPECT_NE(m.find("entry \"b\\x1B[31m\\xC3\\xA9\""), std::string::npos) << m;
  }
  std::remove(path.c_str());
}

TEST(SafetensorsCorrupt, PathsThatAreNotFiles) {
  const std::string missing = temp_path("missing");
  expect_error([&] { (void)io::load_safetensors(missing); }, {"safetensors", "cannot open", missing});
  const std::string dir = ::testing::TempDir();
  expect_error([&] { (void)io::SafetensorsFile(dir); }, {"safetensors", "directory"});
}

// Every prefix of a valid file, and every byte of its header changed, is refused cleanly or
// (for a few header edits, e.g. a space) still parses; nothing else may happen.
TEST(SafetensorsCorrupt, EveryTruncationAndByteEdit) {
  const std::string path = temp_path("prefix");
  io::save_safetensors(path, StateDict{{"w", random_tensor({3, 2}, DType::f32, Device::cpu(), 5)},
                                       {"i", random_tensor({2}, DType::i64, Device::cpu(), 6)}},
                       {{"m", "x"}});
  const std::string good = read_file(path);
  for (std::size_t n = 0; n < good.size(); ++n) {
    write_file(path, good.substr(0, n));
    EXPECT_THROW((void)io::SafetensorsFile(path), Error) << "prefix of " << n << " bytes";
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | static_cast<unsigned char>(good[i]);
  ASSERT_LT(header_len, good.size());
  const std::size_t header_end = 8 + static_cast<std::size_t>(header_len);
  int parsed = 0, refused = 0;
  for (std::size_t i = 0; i < header_end; ++i) {
    for (unsigned char v : {0x00, 0x7d, 0x22, 0x39}) {
      std::string edit = good;
      if (static_cast<unsigned char>(edit[i]) == v) continue;
      edit[i] = static_cast<char>(v);
      write_file(path, edit);
      try {
        const io::SafetensorsFile f(path);
        for (const std::string& name : f.names()) {
          const io::TensorInfo& inf = f.info(name);
          EXPECT_LE(inf.offset + inf.nbytes, f.file_size());
        }
        ++parsed;
      } catch (const Error&) {
        ++refused;
      }
    }
  }
  EXPECT_GT(refused, 0);
  std::remove(path.c_str());
}

// ---- GPU: large tensors through the pinned staging path ----

TEST(SafetensorsCuda, LargeTensorsThroughStaging) {
  FLAME_SKIP_IF_NO_CUDA();
  const Device gpu = Device::cuda(0);
  // 40 MiB and 18 MiB: several 16 MiB staging chunks each, with a ragged last chunk.
  const Tensor big = random_tensor({2560, 4096}, DType::f32, Device::cpu(), 41);
  const Tensor half = random_tensor({3, 1531, 2053}, DType::bf16, Device::cpu(), 42);
  const Tensor small = random_tensor({5}, DType::i32, Device::cpu(), 43);
  const std::string path = temp_path("cuda_big");
  io::save_safetensors(path, StateDict{{"big", big}, {"half", half}, {"small", small}});

  const StateDict g = io::load_safetensors(path, gpu);
  EXPECT_EQ(g.at("big").device(), gpu);
  EXPECT_EQ(bytes_of(g.at("big")), bytes_of(big));
  EXPECT_EQ(bytes_of(g.at("half")), bytes_of(half));
  EXPECT_EQ(bytes_of(g.at("small")), bytes_of(small));

  // Conversion on the GPU matches the CPU's.
  const StateDict gb = io::load_safetensors(path, gpu, DType::f16);
  EXPECT_EQ(gb.at("big").dtype(), DType::f16);
  EXPECT_EQ(bytes_of(gb.at("big")), bytes_of(big.to(DType::f16)));
  EXPECT_EQ(bytes_of(gb.at("half")), bytes_of(half.to(DType::f16)));

  // Saving from the GPU (non-contiguous too) writes the same bytes as saving from the CPU.
  const std::string from_cpu = temp_path("cuda_cpu"), from_gpu = temp_path("cuda_gpu");
  const Tensor tcpu = random_tensor({37, 1029}, DType::f16, Device::cpu(), 44);
  io::save_safetensors(from_cpu, StateDict{{"t", tcpu.t()}, {"big", big}}, {{"k", "v"}});
  io::save_safetensors(from_gpu, StateDict{{"t", tcpu.to(gpu).t()}, {"big", g.at("big")}}, {{"k", "v"}});
  EXPECT_EQ(read_file(from_cpu), read_file(from_gpu));
  for (const std::string& p : {path, from_cpu, from_gpu}) std::remove(p.c_str());
}

}  // namespace
}  // namespace flame::test
