// ImageDataset*: decoding (JPEG, PNG, WebP, EXIF), the Lanczos resize against Pillow, buckets,
// folder and manifest scans with corrupt files and missing captions, item transforms, caption rules
// and the bucketed loader.
#include <gtest/gtest.h>
#include <png.h>

#include <cmath>
#include <csetjmp>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#if FLAME_DIFFUSION_HAVE_JPEG
#include <jpeglib.h>
#endif
#if FLAME_DIFFUSION_HAVE_WEBP
#include <webp/encode.h>
#endif

#include "data_test_util.h"
#include "image_dataset.h"
#include "image_decode.h"

namespace fd = flame_diffusion;
namespace fs = std::filesystem;

namespace {

fd::Image random_image(int w, int h, uint64_t seed, int channels = 3) {
  std::mt19937_64 rng(seed);
  fd::Image img(w, h, channels);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(rng() & 0xFF);
  return img;
}

// Smooth content, which JPEG keeps close.
fd::Image gradient_image(int w, int h) {
  fd::Image img(w, h, 3);
  for (int y = 0; y < h; ++y)
    for (int x = 0; x < w; ++x) {
      uint8_t* p = img.at(x, y);
      p[0] = static_cast<uint8_t>(255 * x / std::max(1, w - 1));
      p[1] = static_cast<uint8_t>(255 * y / std::max(1, h - 1));
      p[2] = static_cast<uint8_t>(128 + 100 * std::sin(0.05 * (x + y)));
    }
  return img;
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void truncate_file(const std::string& path, double keep) {
  std::vector<uint8_t> b = read_all(path);
  b.resize(static_cast<size_t>(b.size() * keep));
  fd_test::write_bytes(path, b);
}

std::string mkdir(const fd_test::ScratchDir& dir, const std::string& rel) {
  const std::string p = dir.file(rel);
  fs::create_directories(p);
  return p;
}

#if FLAME_DIFFUSION_HAVE_JPEG
// A baseline JPEG with an APP1 Exif segment holding only the orientation tag (little-endian TIFF).
void write_jpeg_with_orientation(const std::string& path, const fd::Image& img, int orientation) {
  std::vector<uint8_t> exif = {'E', 'x', 'i', 'f', 0, 0, 'I', 'I', 42, 0, 8, 0, 0, 0,  // TIFF header, IFD0 at 8
                               1, 0,                                                     // one entry
                               0x12, 0x01, 3, 0, 1, 0, 0, 0, static_cast<uint8_t>(orientation), 0, 0, 0,
                               0, 0, 0, 0};  // no next IFD
  FILE* fp = std::fopen(path.c_str(), "wb");
  ASSERT_NE(fp, nullptr);
  jpeg_compress_struct cinfo;
  jpeg_error_mgr err;
  cinfo.err = jpeg_std_error(&err);
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, fp);
  cinfo.image_width = img.width;
  cinfo.image_height = img.height;
  cinfo.input_components = 3;
  cinfo.in_color_space = JCS_RGB;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, 98, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  jpeg_write_marker(&cinfo, JPEG_APP0 + 1, exif.data(), static_cast<unsigned>(exif.size()));
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(img.at(0, static_cast<int>(cinfo.next_scanline)));
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  std::fclose(fp);
}
#endif

#if FLAME_DIFFUSION_HAVE_WEBP
void write_webp_lossless(const std::string& path, const fd::Image& img) {
  uint8_t* out = nullptr;
  const size_t n = WebPEncodeLosslessRGB(img.pixels.data(), img.width, img.height, img.width * 3, &out);
  ASSERT_GT(n, 0u);
  fd_test::write_bytes(path, std::vector<uint8_t>(out, out + n));
  WebPFree(out);
}
#endif

// A small configuration whose buckets are 32x128, 64x64, 96x32 and 128x32 (resolution 64, step 32).
fd::DatasetConfig small_config() {
  fd::DatasetConfig c = fd::default_dataset_config();
  c.resolution = 64;
  c.bucket_step = 32;
  c.bucket_min_size = 32;
  c.bucket_max_size = 128;
  c.bucket_max_aspect = 4.0;
  return c;
}

struct Captured {
  std::vector<std::string> lines;
  fd::ImageDataset::Log log() {
    return [this](const std::string& s) { lines.push_back(s); };
  }
  bool any_contains(const std::string& a, const std::string& b = "") const {
    for (const auto& l : lines)
      if (l.find(a) != std::string::npos && l.find(b) != std::string::npos) return true;
    return false;
  }
};

float pixel_value(uint8_t p) { return static_cast<float>(p) / 127.5f - 1.0f; }

}  // namespace

// ---- decoding ----

TEST(ImageDatasetDecode, PngPixelsAreExact) {
  fd_test::ScratchDir dir;
  const fd::Image rgb = random_image(13, 7, 1);
  fd::write_png(dir.file("rgb.png"), rgb);
  const fd::Image back = fd::decode_image(dir.file("rgb.png"));
  EXPECT_EQ(back.width, 13);
  EXPECT_EQ(back.height, 7);
  EXPECT_EQ(back.channels, 3);
  EXPECT_EQ(back.pixels, rgb.pixels);

  const fd::Image gray = random_image(5, 4, 2, 1);
  fd::write_png(dir.file("gray.png"), gray);
  const fd::Image g = fd::decode_image(dir.file("gray.png"));
  ASSERT_EQ(g.pixels.size(), 5u * 4 * 3);
  for (size_t i = 0; i < gray.pixels.size(); ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(g.pixels[i * 3 + c], gray.pixels[i]) << "pixel " << i;

  // RGBA: the alpha is dropped and the colour kept as stored (PIL's convert("RGB")).
  const fd::Image rgba = random_image(6, 3, 3, 4);
  png_image w;
  std::memset(&w, 0, sizeof w);
  w.version = PNG_IMAGE_VERSION;
  w.width = 6;
  w.height = 3;
  w.format = PNG_FORMAT_RGBA;
  ASSERT_TRUE(png_image_write_to_file(&w, dir.file("rgba.png").c_str(), 0, rgba.pixels.data(), 0, nullptr));
  const fd::Image a = fd::decode_image(dir.file("rgba.png"));
  for (size_t i = 0; i < 18; ++i)
    for (int c = 0; c < 3; ++c) ASSERT_EQ(a.pixels[i * 3 + c], rgba.pixels[i * 4 + c]) << "pixel " << i;
  const fd::ImageInfo info = fd::read_image_info(dir.file("rgba.png"));
  EXPECT_EQ(info.width, 6);
  EXPECT_EQ(info.height, 3);
  EXPECT_EQ(info.format, fd::ImageFileFormat::png);
}

TEST(ImageDatasetDecode, JpegWithinTolerance) {
  if (!fd::image_format_supported(fd::ImageFileFormat::jpeg)) GTEST_SKIP() << "built without libjpeg";
  fd_test::ScratchDir dir;
  const fd::Image img = gradient_image(40, 24);
  fd::write_jpeg(dir.file("a.JPG"), img, 95);
  const fd::Image back = fd::decode_image(dir.file("a.JPG"));
  ASSERT_EQ(back.width, 40);
  ASSERT_EQ(back.height, 24);
  double sum = 0, worst = 0;
  for (size_t i = 0; i < img.pixels.size(); ++i) {
    const double d = std::abs(double(back.pixels[i]) - img.pixels[i]);
    sum += d;
    worst = std::max(worst, d);
  }
  EXPECT_LT(sum / img.pixels.size(), 2.0);  // quality 95 on smooth content: about one level
  EXPECT_LE(worst, 12.0);
}

TEST(ImageDatasetDecode, WebpLosslessIsExact) {
  if (!fd::image_format_supported(fd::ImageFileFormat::webp)) GTEST_SKIP() << "built without libwebp";
#if FLAME_DIFFUSION_HAVE_WEBP
  fd_test::ScratchDir dir;
  const fd::Image img = random_image(11, 9, 4);
  write_webp_lossless(dir.file("x.webp"), img);
  const fd::Image back = fd::decode_image(dir.file("x.webp"));
  EXPECT_EQ(back.width, 11);
  EXPECT_EQ(back.height, 9);
  EXPECT_EQ(back.pixels, img.pixels);
  EXPECT_EQ(fd::read_image_info(dir.file("x.webp")).format, fd::ImageFileFormat::webp);
#endif
}

TEST(ImageDatasetDecode, ExifOrientationTransforms) {
  // [[1, 2, 3], [4, 5, 6]] (3 wide, 2 high) under each orientation, worked out by hand.
  fd::Image in(3, 2, 1);
  for (int i = 0; i < 6; ++i) in.pixels[i] = static_cast<uint8_t>(i + 1);
  const std::vector<std::pair<int, std::vector<uint8_t>>> cases = {
      {1, {1, 2, 3, 4, 5, 6}}, {2, {3, 2, 1, 6, 5, 4}}, {3, {6, 5, 4, 3, 2, 1}}, {4, {4, 5, 6, 1, 2, 3}},
      {5, {1, 4, 2, 5, 3, 6}}, {6, {4, 1, 5, 2, 6, 3}}, {7, {6, 3, 5, 2, 4, 1}}, {8, {3, 6, 2, 5, 1, 4}}};
  for (const auto& [o, want] : cases) {
    const fd::Image out = fd::apply_exif_orientation(in, o);
    EXPECT_EQ(out.width, o >= 5 ? 2 : 3) << "orientation " << o;
    EXPECT_EQ(out.pixels, want) << "orientation " << o;
  }
}

TEST(ImageDatasetDecode, JpegExifOrientationIsApplied) {
  if (!fd::image_format_supported(fd::ImageFileFormat::jpeg)) GTEST_SKIP() << "built without libjpeg";
#if FLAME_DIFFUSION_HAVE_JPEG
  fd_test::ScratchDir dir;
  // Stored 32 wide, 16 high: left half dark, right half bright. Orientation 6 (rotate 90°
  // clockwise to display) puts the stored left half on top.
  fd::Image img(32, 16, 3);
  for (int y = 0; y < 16; ++y)
    for (int x = 0; x < 32; ++x) std::memset(img.at(x, y), x < 16 ? 20 : 230, 3);
  write_jpeg_with_orientation(dir.file("r.jpg"), img, 6);
  const fd::ImageInfo info = fd::read_image_info(dir.file("r.jpg"));
  EXPECT_EQ(info.exif_orientation, 6);
  EXPECT_EQ(info.width, 16);
  EXPECT_EQ(info.height, 32);
  const fd::Image back = fd::decode_image(dir.file("r.jpg"));
  ASSERT_EQ(back.width, 16);
  ASSERT_EQ(back.height, 32);
  EXPECT_NEAR(back.at(8, 4)[0], 20, 8);
  EXPECT_NEAR(back.at(8, 27)[0], 230, 8);
#endif
}

TEST(ImageDatasetDecode, CorruptFilesRaiseNamingTheFile) {
  fd_test::ScratchDir dir;
  std::mt19937_64 rng(5);
  std::vector<uint8_t> noise(300);
  for (auto& b : noise) b = static_cast<uint8_t>(rng());
  fd_test::write_bytes(dir.file("noise.png"), noise);
  try {
    fd::decode_image(dir.file("noise.png"));
    FAIL() << "random bytes decoded";
  } catch (const fd::ImageDecodeError& e) {
    EXPECT_NE(std::string(e.what()).find("noise.png"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("not a JPEG, PNG or WebP"), std::string::npos) << e.what();
  }
  fd::write_png(dir.file("cut.png"), random_image(64, 64, 6));
  truncate_file(dir.file("cut.png"), 0.5);
  EXPECT_THROW(fd::decode_image(dir.file("cut.png")), fd::ImageDecodeError);
  if (fd::image_format_supported(fd::ImageFileFormat::jpeg)) {
    fd::write_jpeg(dir.file("cut.jpg"), gradient_image(64, 64), 90);
    truncate_file(dir.file("cut.jpg"), 0.6);
    try {
      fd::decode_image(dir.file("cut.jpg"));
      FAIL() << "a truncated JPEG decoded";
    } catch (const fd::ImageDecodeError& e) {
      EXPECT_NE(std::string(e.what()).find("cut.jpg: corrupt JPEG"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(fd::decode_image(dir.file("missing.png")), fd::ImageDecodeError);
}

// ---- resize ----

TEST(ImageDatasetResize, LanczosMatchesPillow) {
  // Pillow 11: Image.fromarray(a, "F").resize((w, h), Image.LANCZOS) of the 7x5 image
  // a[y][x] = (37x + 91y + 13xy) % 256 (mode "F": float, no rounding between passes).
  const int W = 7, H = 5;
  std::vector<float> src(W * H);
  for (int y = 0; y < H; ++y)
    for (int x = 0; x < W; ++x) src[y * W + x] = static_cast<float>((x * 37 + y * 91 + x * y * 13) % 256);
  const std::vector<float> pil_3x8 = {
      13.137784f,  104.213333f, 211.972824f, 63.407631f,  136.067963f, 147.882614f, 149.337128f, 166.818069f,
      83.146820f,  189.343140f, 138.417007f, 131.497147f, 148.543655f, 139.473343f, 174.409332f, 86.282135f,
      170.509521f, 153.584702f, 99.407623f,  142.843353f, 125.433380f, 130.762024f, 112.497169f, 110.916252f};
  const std::vector<float> pil_4x2 = {95.643501f,  141.585953f, 134.969147f, 151.556396f,
                                      126.473579f, 139.540268f, 146.610336f, 130.321808f};
  const auto out = fd::resize_lanczos_window(src.data(), W, H, 1, 3, 8, 0, 0, 3, 8);
  ASSERT_EQ(out.size(), pil_3x8.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], pil_3x8[i], 2e-4) << "3x8 sample " << i;
  const auto small = fd::resize_lanczos_window(src.data(), W, H, 1, 4, 2, 0, 0, 4, 2);
  for (size_t i = 0; i < small.size(); ++i) EXPECT_NEAR(small[i], pil_4x2[i], 2e-4) << "4x2 sample " << i;

  // A window is the same samples as the full resize; mirrored, its columns reversed.
  const auto win = fd::resize_lanczos_window(src.data(), W, H, 1, 3, 8, 1, 2, 2, 5);
  const auto mir = fd::resize_lanczos_window(src.data(), W, H, 1, 3, 8, 1, 2, 2, 5, true);
  for (int y = 0; y < 5; ++y)
    for (int x = 0; x < 2; ++x) {
      EXPECT_FLOAT_EQ(win[y * 2 + x], out[(y + 2) * 3 + x + 1]);
      EXPECT_FLOAT_EQ(mir[y * 2 + x], out[(y + 2) * 3 + (1 - x) + 1]);
    }
  // Interleaved channels resize independently; uint8 input is the same as its float copy.
  std::vector<uint8_t> rgb(W * H * 3);
  std::vector<float> rgbf(rgb.size());
  for (int i = 0; i < W * H; ++i)
    for (int c = 0; c < 3; ++c) rgbf[i * 3 + c] = rgb[i * 3 + c] = static_cast<uint8_t>(c == 1 ? src[i] : 255 - src[i]);
  const auto o8 = fd::resize_lanczos_window(rgb.data(), W, H, 3, 3, 8, 0, 0, 3, 8);
  const auto of = fd::resize_lanczos_window(rgbf.data(), W, H, 3, 3, 8, 0, 0, 3, 8);
  EXPECT_EQ(o8, of);
  for (size_t i = 0; i < pil_3x8.size(); ++i) {
    EXPECT_NEAR(o8[i * 3 + 1], pil_3x8[i], 2e-4);
    EXPECT_NEAR(o8[i * 3 + 0], 255.0f - pil_3x8[i], 2e-4);  // the weights sum to 1
  }
  EXPECT_THROW(fd::resize_lanczos_window(src.data(), W, H, 1, 3, 8, 2, 0, 2, 8), std::invalid_argument);
}

// ---- buckets ----

TEST(ImageDatasetBuckets, StandardBucketsAndNearest) {
  const fd::DatasetConfig c = fd::default_dataset_config();  // 1024, step 64, sides 256..2048, aspect <= 4
  const auto buckets = fd::make_buckets(c);
  std::set<std::pair<int, int>> set;
  for (const auto& b : buckets) {
    set.insert({b.width, b.height});
    EXPECT_EQ(b.width % 64, 0);
    EXPECT_EQ(b.height % 64, 0);
    EXPECT_LE(int64_t{b.width} * b.height, 1024 * 1024);
    EXPECT_GT(int64_t{b.width} * (b.height + 64), 1024 * 1024) << "h is the largest fitting height";
    EXPECT_LE(std::max(b.width, b.height), 4 * std::min(b.width, b.height));
  }
  // SDXL's well-known buckets are among them; 256 wide would need 4096 high (over 2048).
  for (auto wh : {std::pair{1024, 1024}, {832, 1216}, {1216, 832}, {896, 1152}, {512, 2048}, {2048, 512}})
    EXPECT_TRUE(set.count(wh)) << wh.first << "x" << wh.second;
  EXPECT_FALSE(set.count({256, 2048}));
  EXPECT_EQ(set.size(), buckets.size());
  auto nearest = [&](int w, int h) {
    const auto& b = buckets[fd::nearest_bucket(buckets, w, h)];
    return std::pair{b.width, b.height};
  };
  EXPECT_EQ(nearest(1200, 800), (std::pair{1216, 832}));  // 1.5: log distance .026 vs .105 (1280x768)
  EXPECT_EQ(nearest(3000, 3000), (std::pair{1024, 1024}));
  EXPECT_EQ(nearest(100, 1000), (std::pair{512, 2048}));  // beyond the aspect limit: the most extreme
}

// ---- scanning ----

TEST(ImageDatasetScan, FoldersCaptionsRepeatsAndCorruptFiles) {
  fd_test::ScratchDir dir;
  const std::string root = mkdir(dir, "train");
  mkdir(dir, "train/10_cat/sub");
  mkdir(dir, "train/2_dog");
  mkdir(dir, "train/plain");
  mkdir(dir, "train/.hidden");
  fd::write_png(dir.file("train/10_cat/a.png"), random_image(64, 64, 7));
  write_text(dir.file("train/10_cat/a.txt"), "  cat,\nsitting \n");
  fd::write_png(dir.file("train/10_cat/sub/b.PNG"), random_image(96, 48, 8));  // no caption
  fd::write_png(dir.file("train/2_dog/c.png"), random_image(64, 64, 9));
  write_text(dir.file("train/2_dog/c.caption"), "dog");
  write_text(dir.file("train/2_dog/c.txt"), "not this one");
  fd::write_png(dir.file("train/plain/d.png"), random_image(32, 128, 10));
  write_text(dir.file("train/plain/d.caption"), "tall");
  fd::write_png(dir.file("train/.hidden/e.png"), random_image(64, 64, 11));
  write_text(dir.file("train/notes.md"), "not an image");
  fd_test::write_bytes(dir.file("train/junk.png"), {1, 2, 3, 4, 5, 6, 7, 8, 9});
  fd::write_png(dir.file("train/10_cat/cut.png"), random_image(64, 64, 12));
  truncate_file(dir.file("train/10_cat/cut.png"), 0.4);

  fd::DatasetConfig c = small_config();
  c.folders = {root};
  c.caption_extension = "caption";  // without the dot works too
  Captured log;
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, log.log());
  ASSERT_EQ(ds.records().size(), 4u);
  std::map<std::string, const fd::ImageRecord*> by_name;
  for (const auto& r : ds.records()) by_name[fs::path(r.path).filename().string()] = &r;
  ASSERT_TRUE(by_name.count("a.png") && by_name.count("b.PNG") && by_name.count("c.png") && by_name.count("d.png"));
  EXPECT_EQ(by_name["a.png"]->repeats, 10);
  EXPECT_EQ(by_name["b.PNG"]->repeats, 10);  // the nearest N_ folder above it
  EXPECT_EQ(by_name["c.png"]->repeats, 2);
  EXPECT_EQ(by_name["d.png"]->repeats, 1);
  EXPECT_EQ(by_name["a.png"]->caption, "");  // a.txt is not the .caption file
  EXPECT_EQ(by_name["c.png"]->caption, "dog");
  EXPECT_EQ(by_name["d.png"]->caption, "tall");
  EXPECT_EQ(ds.buckets()[by_name["b.PNG"]->bucket], (fd::Bucket{96, 32}));
  EXPECT_EQ(ds.buckets()[by_name["d.png"]->bucket], (fd::Bucket{32, 128}));
  EXPECT_EQ(ds.buckets()[by_name["a.png"]->bucket], (fd::Bucket{64, 64}));
  EXPECT_TRUE(log.any_contains("skipped", "junk.png"));
  EXPECT_TRUE(log.any_contains("skipped", "cut.png"));
  EXPECT_TRUE(log.any_contains("no caption", "b.PNG"));
  EXPECT_FALSE(log.any_contains("e.png"));
  EXPECT_EQ(ds.warnings().size(), 4u);  // junk, cut, and the captions of a and b
  // The histogram: 64x64 holds a and c (10 + 2 with repeats).
  EXPECT_TRUE(log.any_contains("64x64", "2 images (12 with repeats)")) << ds.bucket_histogram();
  EXPECT_NE(ds.bucket_histogram().find("96x32"), std::string::npos);

  // .txt captions: a's is read whole and trimmed, line breaks as spaces.
  c.caption_extension = ".txt";
  const fd::ImageDataset txt = fd::ImageDataset::scan(c, [](const std::string&) {});
  for (const auto& r : txt.records())
    if (r.path.ends_with("a.png")) EXPECT_EQ(r.caption, "cat, sitting");

  // Explicit repeats override the folder name for everything under the folder.
  c.folders = {dir.file("train/10_cat"), dir.file("train/plain")};
  c.folder_repeats = {3, 0};
  c.repeats = 5;
  const fd::ImageDataset ex = fd::ImageDataset::scan(c, [](const std::string&) {});
  ASSERT_EQ(ex.records().size(), 3u);
  for (const auto& r : ex.records()) EXPECT_EQ(r.repeats, r.path.ends_with("d.png") ? 5 : 3) << r.path;

  // Not recursive: only the folder's own files, here just the junk one: an error naming the folder.
  c.folders = {root};
  c.folder_repeats = {};
  c.recursive = false;
  try {
    fd::ImageDataset::scan(c, [](const std::string&) {});
    FAIL() << "an empty data set was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("no usable image in " + root), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1 skipped"), std::string::npos) << e.what();
  }
  c.folders = {dir.file("nowhere")};
  EXPECT_THROW(fd::ImageDataset::scan(c, [](const std::string&) {}), std::runtime_error);
}

TEST(ImageDatasetScan, JsonlManifest) {
  fd_test::ScratchDir dir;
  mkdir(dir, "set/img");
  fd::write_png(dir.file("set/img/1.png"), random_image(64, 64, 20));
  fd::write_png(dir.file("set/img/2.png"), random_image(128, 32, 21));
  write_text(dir.file("set/img/2.txt"), "from the caption file");
  write_text(dir.file("set/m.jsonl"),
             "{\"file\": \"img/1.png\", \"caption\": \" a red square \", \"repeats\": 4}\n"
             "\n"
             "{\"file\": \"img/2.png\"}\n"
             "{\"file\": \"img/3.png\", \"caption\": \"missing\"}\n");
  fd::DatasetConfig c = small_config();
  c.manifest = dir.file("set/m.jsonl");
  Captured log;
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, log.log());
  ASSERT_EQ(ds.records().size(), 2u);
  EXPECT_EQ(ds.records()[0].caption, "a red square");
  EXPECT_EQ(ds.records()[0].repeats, 4);
  EXPECT_EQ(ds.records()[1].caption, "from the caption file");
  EXPECT_EQ(ds.records()[1].repeats, 1);
  EXPECT_TRUE(log.any_contains("skipped", "3.png"));

  for (const auto& [line, what] : std::vector<std::pair<std::string, std::string>>{
           {"{\"file\": \"img/1.png\"}\nnot json\n", "m.jsonl:2: not a JSON object"},
           {"{\"caption\": \"x\"}\n", "m.jsonl:1: each line must be an object with a \"file\" string"},
           {"{\"file\": \"img/1.png\", \"repeats\": 0}\n", "m.jsonl:1: \"repeats\" must be an integer >= 1"},
           {"{\"file\": \"img/1.png\", \"caption\": 3}\n", "m.jsonl:1: \"caption\" must be a string"}}) {
    write_text(dir.file("set/m.jsonl"), line);
    try {
      fd::ImageDataset::scan(c, [](const std::string&) {});
      FAIL() << "accepted: " << line;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

TEST(ImageDatasetScan, UpscaleLimitGivesSmallerBucketsOrSkips) {
  fd_test::ScratchDir dir;
  mkdir(dir, "s");
  fd::write_png(dir.file("s/big.png"), random_image(256, 256, 30));
  fd::write_png(dir.file("s/mid.png"), random_image(300, 200, 31));
  fd::write_png(dir.file("s/tiny.png"), random_image(100, 100, 32));
  fd::DatasetConfig c = fd::default_dataset_config();
  c.folders = {dir.file("s")};
  c.resolution = 256;
  c.bucket_min_size = 128;
  c.bucket_max_size = 512;
  Captured log;
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, log.log());
  ASSERT_EQ(ds.records().size(), 2u);
  for (const auto& r : ds.records()) {
    const fd::Bucket b = ds.buckets()[r.bucket];
    if (r.path.ends_with("big.png")) EXPECT_EQ(b, (fd::Bucket{256, 256}));
    // 300x200 is nearest 320x192, which needs 1.067x: its own size rounded down to 64 instead.
    if (r.path.ends_with("mid.png")) EXPECT_EQ(b, (fd::Bucket{256, 192}));
  }
  EXPECT_TRUE(log.any_contains("skipped", "tiny.png"));
  EXPECT_TRUE(log.any_contains("tiny.png", "dataset.max_upscale"));
  // Allowing 3x upscaling keeps them all in standard buckets.
  c.max_upscale = 3.0;
  const fd::ImageDataset up = fd::ImageDataset::scan(c, [](const std::string&) {});
  EXPECT_EQ(up.records().size(), 3u);
  // Bucketing off: one square bucket, and images it would enlarge are skipped.
  c.max_upscale = 1.0;
  c.bucketing = false;
  Captured off;
  const fd::ImageDataset sq = fd::ImageDataset::scan(c, off.log());
  ASSERT_EQ(sq.records().size(), 1u);
  EXPECT_EQ(sq.buckets()[sq.records()[0].bucket], (fd::Bucket{256, 256}));
  EXPECT_TRUE(off.any_contains("mid.png", "bucketing is off"));
}

TEST(ImageDatasetScan, BadSettingsNameTheKey) {
  fd::DatasetConfig c = small_config();
  auto expect_error = [&](const fd::DatasetConfig& cfg, const std::string& what) {
    try {
      fd::ImageDataset::scan(cfg, [](const std::string&) {});
      FAIL() << "accepted; expected: " << what;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  expect_error(c, "set dataset.folders");
  c.folders = {"x", "y"};
  c.folder_repeats = {1};
  expect_error(c, "dataset.folder_repeats has 1 entries for 2 dataset.folders");
  c.folder_repeats = {};
  c.resolution = 80;
  expect_error(c, "dataset.resolution = 80 is not a multiple of dataset.bucket_step = 32");
  c.resolution = 256;
  expect_error(c, "bucket_min_size <= resolution <= bucket_max_size");
  c.resolution = 64;
  c.crop = "middle";
  expect_error(c, "dataset.crop = \"middle\"");
}

// ---- items ----

TEST(ImageDatasetItem, CropFlipAndValues) {
  fd_test::ScratchDir dir;
  mkdir(dir, "i");
  // 64 wide, 80 high: the 64x64 bucket without resizing, so values are the pixels themselves.
  const fd::Image img = random_image(64, 80, 40);
  fd::write_png(dir.file("i/p.png"), img);
  write_text(dir.file("i/p.txt"), "one, two, three");
  fd::DatasetConfig c = small_config();
  c.folders = {dir.file("i")};
  c.crop = "random";
  c.flip_p = 0.5;
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, [](const std::string&) {});
  std::set<int> offsets;
  int flips = 0;
  for (uint64_t seed = 0; seed < 40; ++seed) {
    const fd::ImageItem item = ds.item(0, seed);
    EXPECT_EQ(item.bucket, (fd::Bucket{64, 64}));
    EXPECT_EQ(item.crop.resized_width, 64);
    EXPECT_EQ(item.crop.resized_height, 80);
    EXPECT_EQ(item.crop.x, 0);
    ASSERT_GE(item.crop.y, 0);
    ASSERT_LE(item.crop.y, 16);
    EXPECT_EQ(item.original_width, 64);
    EXPECT_EQ(item.original_height, 80);
    EXPECT_EQ(item.caption, "one, two, three");
    offsets.insert(item.crop.y);
    flips += item.flipped;
    ASSERT_EQ(item.image.shape(), (flame::Shape{3, 64, 64}));
    const std::vector<float> v = item.image.to_vec<float>();
    for (int ch = 0; ch < 3; ++ch)
      for (int y = 0; y < 64; y += 7)
        for (int x = 0; x < 64; x += 5) {
          const int sx = item.flipped ? 63 - x : x;
          ASSERT_EQ(v[(ch * 64 + y) * 64 + x], pixel_value(img.at(sx, y + item.crop.y)[ch]))
              << "seed " << seed << " c " << ch << " y " << y << " x " << x;
        }
    // The same seed gives the same item.
    const fd::ImageItem again = ds.item(0, seed);
    EXPECT_EQ(again.crop, item.crop);
    EXPECT_EQ(again.flipped, item.flipped);
  }
  EXPECT_GT(offsets.size(), 5u);
  EXPECT_GT(flips, 8);
  EXPECT_LT(flips, 32);

  // Centre crop, no flips: y = (80 - 64) / 2.
  c.crop = "center";
  c.flip_p = 0.0;
  const fd::ImageDataset centre = fd::ImageDataset::scan(c, [](const std::string&) {});
  const fd::ImageItem it = centre.item(0, 123);
  EXPECT_EQ(it.crop, (fd::CropBox{0, 8, 64, 64, 64, 80}));
  EXPECT_FALSE(it.flipped);
  EXPECT_EQ(it.image.to_vec<float>()[0], pixel_value(img.at(0, 8)[0]));
}

TEST(ImageDatasetItem, ResizedItemIsTheLanczosWindow) {
  fd_test::ScratchDir dir;
  mkdir(dir, "r");
  const fd::Image img = random_image(128, 64, 41);  // aspect 2: the 96x32 bucket, resized to 96x48
  fd::write_png(dir.file("r/w.png"), img);
  fd::DatasetConfig c = small_config();
  c.folders = {dir.file("r")};
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, [](const std::string&) {});
  const fd::ImageItem item = ds.item(0, 7);
  EXPECT_EQ(item.crop, (fd::CropBox{0, 8, 96, 32, 96, 48}));
  const auto ref = fd::resize_lanczos_window(img.pixels.data(), 128, 64, 3, 96, 48, 0, 8, 96, 32);
  const std::vector<float> v = item.image.to_vec<float>();
  for (int ch = 0; ch < 3; ++ch)
    for (int y = 0; y < 32; ++y)
      for (int x = 0; x < 96; ++x) {
        const float want = std::clamp(ref[(y * 96 + x) * 3 + ch], 0.0f, 255.0f) / 127.5f - 1.0f;
        ASSERT_FLOAT_EQ(v[(ch * 32 + y) * 96 + x], want) << ch << " " << y << " " << x;
      }
}

TEST(ImageDatasetItem, FileBrokenAfterTheScanFallsBackWithinItsBucket) {
  fd_test::ScratchDir dir;
  mkdir(dir, "f");
  fd::write_png(dir.file("f/a.png"), random_image(64, 64, 50));
  fd::write_png(dir.file("f/b.png"), random_image(64, 64, 51));
  fd::DatasetConfig c = small_config();
  c.folders = {dir.file("f")};
  Captured log;
  const fd::ImageDataset ds = fd::ImageDataset::scan(c, log.log());
  fd_test::write_bytes(dir.file("f/a.png"), {0, 1, 2});
  const fd::ImageItem item = ds.item(0, 1);
  EXPECT_TRUE(item.path.ends_with("b.png"));
  EXPECT_TRUE(log.any_contains("a.png", "using the next image of its bucket"));
  fd_test::write_bytes(dir.file("f/b.png"), {0, 1, 2});
  EXPECT_THROW(ds.item(0, 1), std::runtime_error);
}

// ---- captions ----

TEST(ImageDatasetCaptions, DropoutShuffleKeepTokensPrefixSuffix) {
  fd::DatasetConfig c = fd::default_dataset_config();
  const std::string cap = "char, red hair, smiling, outdoors, night , , blue sky";
  EXPECT_EQ(fd::transform_caption(cap, c, 1), cap);  // nothing on: as is
  c.caption_prefix = "photo of ";
  c.caption_suffix = ", best";
  EXPECT_EQ(fd::transform_caption("x", c, 1), "photo of x, best");
  c.caption_prefix = c.caption_suffix = "";

  c.shuffle_tags = true;
  c.keep_tokens = 2;
  std::set<std::string> orders;
  const std::multiset<std::string> want = {"smiling", "outdoors", "night", "blue sky"};
  for (uint64_t s = 0; s < 50; ++s) {
    const std::string out = fd::transform_caption(cap, c, s);
    EXPECT_EQ(out, fd::transform_caption(cap, c, s));  // deterministic in the seed
    ASSERT_TRUE(out.starts_with("char, red hair, ")) << out;
    std::multiset<std::string> rest;
    std::stringstream ss(out.substr(std::string("char, red hair, ").size()));
    for (std::string t; std::getline(ss, t, ',');) rest.insert(t.substr(t.find_first_not_of(' ')));
    EXPECT_EQ(rest, want) << out;  // empty tags dropped, the rest trimmed and kept
    orders.insert(out);
  }
  EXPECT_GT(orders.size(), 10u);  // 4! = 24 orders possible

  c.shuffle_tags = false;
  c.caption_dropout = 0.3;
  int dropped = 0;
  for (uint64_t s = 0; s < 4000; ++s) dropped += fd::transform_caption("a cat", c, s).empty();
  EXPECT_NEAR(dropped / 4000.0, 0.3, 0.03);  // 4 standard deviations
  c.caption_dropout = 1.0;
  c.caption_prefix = "p ";
  EXPECT_EQ(fd::transform_caption("a cat", c, 9), "");  // a dropped caption has no prefix either
}

TEST(ImageDatasetCaptions, RepeatsFromFolderNames) {
  EXPECT_EQ(fd::repeats_from_folder_name("10_cat"), 10);
  EXPECT_EQ(fd::repeats_from_folder_name("3_a_b"), 3);
  EXPECT_EQ(fd::repeats_from_folder_name("cat_10"), 0);
  EXPECT_EQ(fd::repeats_from_folder_name("_x"), 0);
  EXPECT_EQ(fd::repeats_from_folder_name("10cat"), 0);
  EXPECT_EQ(fd::repeats_from_folder_name("1x_cat"), 0);
}

// ---- batches ----

TEST(ImageDatasetLoader, BatchesComeFromOneBucketDeterministically) {
  fd_test::ScratchDir dir;
  mkdir(dir, "l/3_sq");
  mkdir(dir, "l/wide");
  for (int i = 0; i < 3; ++i) {
    fd::write_png(dir.file("l/3_sq/s" + std::to_string(i) + ".png"), random_image(64, 64, 60 + i));
    write_text(dir.file("l/3_sq/s" + std::to_string(i) + ".txt"), "square " + std::to_string(i));
  }
  for (int i = 0; i < 5; ++i) {
    fd::write_png(dir.file("l/wide/w" + std::to_string(i) + ".png"), random_image(96, 32, 70 + i));
    write_text(dir.file("l/wide/w" + std::to_string(i) + ".txt"), "wide " + std::to_string(i));
  }
  fd::DatasetConfig c = small_config();
  c.folders = {dir.file("l")};
  c.flip_p = 0.5;
  auto ds = std::make_shared<const fd::ImageDataset>(fd::ImageDataset::scan(c, [](const std::string&) {}));
  ASSERT_EQ(ds->records().size(), 8u);

  // 9 square items (3 x 3 repeats) -> 3 batches of 4 with padding; 5 wide -> 2 batches of 4.
  const fd::BucketBatchSampler sampler(*ds, 4, 11);
  EXPECT_EQ(sampler.num_samples(), 12 + 8);
  for (int64_t e = 0; e < 3; ++e) {
    const auto idx = sampler.indices(e);
    ASSERT_EQ(static_cast<int64_t>(idx.size()), sampler.num_samples());
    std::map<int64_t, int> seen;
    for (size_t b = 0; b < idx.size(); b += 4) {
      for (size_t j = 0; j < 4; ++j) {
        EXPECT_EQ(ds->records()[idx[b + j]].bucket, ds->records()[idx[b]].bucket) << "epoch " << e;
        ++seen[idx[b + j]];
      }
    }
    for (int64_t r = 0; r < 8; ++r) EXPECT_GE(seen[r], ds->records()[r].repeats) << "record " << r;
  }
  EXPECT_NE(sampler.indices(0), sampler.indices(1));
  EXPECT_EQ(sampler.indices(1), fd::BucketBatchSampler(*ds, 4, 11).indices(1));
  // Two ranks: 5 batches padded to 6, rank r takes batches r, r + 2, r + 4 of the same epoch list.
  const fd::BucketBatchSampler r0(*ds, 4, 11, true, 2, 0), r1(*ds, 4, 11, true, 2, 1);
  EXPECT_EQ(r0.num_samples(), 12);
  EXPECT_EQ(r1.num_samples(), 12);
  for (int64_t e = 0; e < 2; ++e) {
    const auto all = sampler.indices(e), a0 = r0.indices(e), a1 = r1.indices(e);
    ASSERT_EQ(a0.size(), 12u);
    ASSERT_EQ(a1.size(), 12u);
    for (size_t k = 0; k < 3; ++k) {
      for (size_t j = 0; j < 4; ++j) {
        EXPECT_EQ(a0[k * 4 + j], all[(2 * k) * 4 + j]) << "epoch " << e;
        EXPECT_EQ(a1[k * 4 + j], all[((2 * k + 1) % 5) * 4 + j]) << "epoch " << e;  // the last one wraps
      }
    }
  }
  EXPECT_THROW(fd::BucketBatchSampler(*ds, 4, 11, true, 2, 2), std::runtime_error);

  fd::ImageLoader a(ds, {.batch_size = 4, .seed = 11, .num_workers = 0});
  fd::ImageLoader b(ds, {.batch_size = 4, .seed = 11, .num_workers = 2});
  EXPECT_EQ(a.batches_per_epoch(), 5);
  std::vector<fd::ImageBatch> first;
  for (int i = 0; i < 7; ++i) {  // into the second epoch
    fd::ImageBatch x = a.next();
    fd::ImageBatch y = b.next();
    ASSERT_EQ(x.items.size(), 4u);
    const fd::Bucket bucket = x.items[0].bucket;
    EXPECT_EQ(x.images.shape(), (flame::Shape{4, 3, bucket.height, bucket.width}));
    for (size_t j = 0; j < 4; ++j) {
      EXPECT_EQ(x.items[j].bucket, bucket);
      EXPECT_EQ(x.items[j].record, y.items[j].record);
      EXPECT_EQ(x.items[j].flipped, y.items[j].flipped);
      EXPECT_FALSE(x.items[j].image.defined());
      const std::string stem = fs::path(x.items[j].path).stem().string();
      EXPECT_EQ(x.items[j].caption, (stem[0] == 's' ? "square " : "wide ") + stem.substr(1));
    }
    EXPECT_EQ(x.images.to_vec<float>(), y.images.to_vec<float>());
    EXPECT_EQ(x.position.epoch, i / 5);
    EXPECT_EQ(x.position.batch, i % 5);
    first.push_back(std::move(x));
  }
  // Resuming at (1, 1) gives batch 6 again.
  fd::ImageLoader resumed(ds, {.batch_size = 4, .seed = 11, .num_workers = 1}, {1, 1, 11});
  const fd::ImageBatch r = resumed.next();
  for (size_t j = 0; j < 4; ++j) EXPECT_EQ(r.items[j].record, first[6].items[j].record);
  EXPECT_EQ(r.images.to_vec<float>(), first[6].images.to_vec<float>());
}
