// PNG and JPEG writing and sample grids (png_image.h; not png.h, which would hide libpng's <png.h>
// on the include path).
#include "png_image.h"

#include <png.h>

#include "plot.h"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#ifdef FLAME_DIFFUSION_HAVE_JPEG
#include <jerror.h>
#include <jpeglib.h>
#endif

namespace flame_diffusion {
namespace {

// Note [libpng errors]
// libpng calls its error function and expects it not to return; the default one longjmps to the
// png_jmpbuf. Throwing a C++ exception through libpng's C frames is undefined, so the error
// function copies the message into this struct and longjmps back into write_rows, whose frame holds
// no C++ objects with destructors between setjmp and the libpng calls; the caller throws afterwards.
struct PngErrorState {
  char message[256] = {0};
};

void on_png_error(png_structp png, png_const_charp msg) {
  auto* st = static_cast<PngErrorState*>(png_get_error_ptr(png));
  std::snprintf(st->message, sizeof st->message, "%s", msg ? msg : "unknown libpng error");
  png_longjmp(png, 1);
}

void on_png_warning(png_structp, png_const_charp) {}

// Returns true on success; on failure `err` holds libpng's message. Plain C-style on purpose
// (Note [libpng errors]).
bool write_rows(FILE* fp, const Image& img, png_bytep* rows, PngErrorState* err) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, err, on_png_error, on_png_warning);
  if (png == nullptr) {
    std::snprintf(err->message, sizeof err->message, "png_create_write_struct failed");
    return false;
  }
  png_infop info = png_create_info_struct(png);
  if (info == nullptr) {
    png_destroy_write_struct(&png, nullptr);
    std::snprintf(err->message, sizeof err->message, "png_create_info_struct failed");
    return false;
  }
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return false;
  }
  png_init_io(png, fp);
  png_set_IHDR(png, info, static_cast<png_uint_32>(img.width), static_cast<png_uint_32>(img.height), 8,
               img.channels == 3 ? PNG_COLOR_TYPE_RGB : PNG_COLOR_TYPE_GRAY, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return true;
}

// The checks every writer makes (`where` names the writer and the file).
void check_image(const std::string& where, const Image& image) {
  if (image.channels != 1 && image.channels != 3) {
    throw std::runtime_error(where + std::to_string(image.channels) + " channels: only 1 (gray) or 3 (RGB)");
  }
  if (image.width <= 0 || image.height <= 0 || image.width > 1000000 || image.height > 1000000) {
    throw std::runtime_error(where + "bad size " + std::to_string(image.width) + "x" + std::to_string(image.height));
  }
  if (image.pixels.size() != static_cast<std::size_t>(image.width) * image.height * image.channels) {
    throw std::runtime_error(where + std::to_string(image.pixels.size()) + " bytes of pixels for a " +
                             std::to_string(image.width) + "x" + std::to_string(image.height) + "x" +
                             std::to_string(image.channels) + " image");
  }
}

// Renames the finished temporary over `path` (removing it on failure).
void commit(const std::string& where, const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    std::remove(tmp.c_str());
    throw std::runtime_error(where + "cannot rename " + tmp + " (" + why + ")");
  }
}

#ifdef FLAME_DIFFUSION_HAVE_JPEG
// libjpeg reports errors as libpng does, through an error_exit that must not return: the same
// scheme (Note [libpng errors]): the message is copied out and jpeg_rows longjmps back.
struct JpegErrorState {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {0};
};

void on_jpeg_error(j_common_ptr cinfo) {
  auto* st = reinterpret_cast<JpegErrorState*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, st->message);
  std::longjmp(st->jump, 1);
}

void on_jpeg_message(j_common_ptr, int) {}

bool jpeg_rows(FILE* fp, const Image& img, int quality, JpegErrorState* err) {
  jpeg_compress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = on_jpeg_error;
  err->mgr.emit_message = on_jpeg_message;
  if (setjmp(err->jump)) {
    jpeg_destroy_compress(&cinfo);
    return false;
  }
  jpeg_create_compress(&cinfo);
  jpeg_stdio_dest(&cinfo, fp);
  cinfo.image_width = static_cast<JDIMENSION>(img.width);
  cinfo.image_height = static_cast<JDIMENSION>(img.height);
  cinfo.input_components = img.channels;
  cinfo.in_color_space = img.channels == 3 ? JCS_RGB : JCS_GRAYSCALE;
  jpeg_set_defaults(&cinfo);
  jpeg_set_quality(&cinfo, quality, TRUE);
  jpeg_start_compress(&cinfo, TRUE);
  while (cinfo.next_scanline < cinfo.image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(img.at(0, static_cast<int>(cinfo.next_scanline)));
    jpeg_write_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_compress(&cinfo);
  jpeg_destroy_compress(&cinfo);
  return true;
}
#endif

std::string lower_extension(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext;
}

}  // namespace

bool jpeg_supported() {
#ifdef FLAME_DIFFUSION_HAVE_JPEG
  return true;
#else
  return false;
#endif
}

void write_jpeg(const std::string& path, const Image& image, int quality) {
  const std::string where = "write_jpeg " + path + ": ";
#ifdef FLAME_DIFFUSION_HAVE_JPEG
  check_image(where, image);
  if (quality < 1 || quality > 100) throw std::runtime_error(where + "quality " + std::to_string(quality) + " not in 1..100");
  const std::string tmp = path + ".tmp";
  FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (fp == nullptr) throw std::runtime_error(where + "cannot open " + tmp + " for writing (" + std::strerror(errno) + ")");
  JpegErrorState err;
  const bool ok = jpeg_rows(fp, image, quality, &err);
  const bool closed = std::fclose(fp) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    throw std::runtime_error(where + (ok ? std::string("closing the file failed (") + std::strerror(errno) + ")"
                                         : std::string("libjpeg: ") + err.message));
  }
  commit(where, tmp, path);
#else
  (void)image;
  (void)quality;
  throw std::runtime_error(where + "this build has no JPEG writer (libjpeg was not found when it was configured: "
                                   "install libjpeg-dev, or write a .png)");
#endif
}

ImageFormat image_format_of(const std::string& path, const std::string& flag) {
  const std::string ext = lower_extension(path);
  if (ext == ".png") return ImageFormat::png;
  if (ext == ".jpg" || ext == ".jpeg") {
    if (!jpeg_supported())
      throw std::runtime_error(flag + " " + path + ": this build writes no JPEG (libjpeg was not found when it was "
                               "configured: install libjpeg-dev and rebuild, or write a .png)");
    return ImageFormat::jpeg;
  }
  throw std::runtime_error(flag + " " + path + ": " +
                           (ext.empty() ? std::string("no file extension") : "unsupported image type '" + ext + "'") +
                           "; write .png, .jpg or .jpeg");
}

void write_image(const std::string& path, const Image& image) {
  if (image_format_of(path, "write_image") == ImageFormat::jpeg) write_jpeg(path, image);
  else write_png(path, image);
}

void check_output_image_path(const std::string& path, const std::string& flag) {
  (void)image_format_of(path, flag);
  namespace fs = std::filesystem;
  const fs::path p(path);
  std::error_code ec;
  if (fs::is_directory(p, ec)) throw std::runtime_error(flag + " " + path + " is a folder; give a file name such as " + (p / "grid.png").string());
  const fs::path dir = p.has_parent_path() ? p.parent_path() : fs::path(".");
  if (!fs::exists(dir, ec))
    throw std::runtime_error(flag + " " + path + ": the folder " + dir.string() + " does not exist (create it first)");
  if (!fs::is_directory(dir, ec)) throw std::runtime_error(flag + " " + path + ": " + dir.string() + " is not a folder");
}

Image::Image(int w, int h, int c, uint8_t fill)
    : width(w), height(h), channels(c), pixels(static_cast<std::size_t>(w) * h * c, fill) {}

void write_png(const std::string& path, const Image& image) {
  const std::string where = "write_png " + path + ": ";
  check_image(where, image);
  std::vector<png_bytep> rows(static_cast<std::size_t>(image.height));
  for (int y = 0; y < image.height; ++y) rows[y] = const_cast<png_bytep>(image.at(0, y));

  const std::string tmp = path + ".tmp";
  FILE* fp = std::fopen(tmp.c_str(), "wb");
  if (fp == nullptr) throw std::runtime_error(where + "cannot open " + tmp + " for writing (" + std::strerror(errno) + ")");
  PngErrorState err;
  const bool ok = write_rows(fp, image, rows.data(), &err);
  const bool closed = std::fclose(fp) == 0;
  if (!ok || !closed) {
    std::remove(tmp.c_str());
    throw std::runtime_error(where + (ok ? std::string("closing the file failed (") + std::strerror(errno) + ")"
                                         : std::string("libpng: ") + err.message));
  }
  commit(where, tmp, path);
}

uint8_t to_pixel(float x) {
  if (!(x > -1.0f)) return 0;  // also NaN
  if (x >= 1.0f) return 255;
  return static_cast<uint8_t>(std::lround((x + 1.0f) * 127.5f));
}

Image make_grid(const flame::Tensor& images, const GridOptions& o) {
  if (!images.defined() || images.dim() != 4) {
    throw std::runtime_error("make_grid: expected images [N, C, H, W], got " +
                             (images.defined() ? flame::shape_str(images.sizes()) : std::string("an undefined tensor")));
  }
  const int64_t n = images.size(0), c = images.size(1), h = images.size(2), w = images.size(3);
  if (c != 1 && c != 3) throw std::runtime_error("make_grid: " + std::to_string(c) + " channels: only 1 or 3");
  if (n == 0 || h == 0 || w == 0) throw std::runtime_error("make_grid: empty images " + flame::shape_str(images.sizes()));
  if (o.cols <= 0 || o.padding < 0 || o.scale < 1 || o.scale > 16) {
    throw std::runtime_error("make_grid: cols " + std::to_string(o.cols) + ", padding " + std::to_string(o.padding) +
                             ", scale " + std::to_string(o.scale) + ": need cols >= 1, padding >= 0, scale 1..16");
  }
  const std::vector<float> v = images.to_vec<float>();  // waits for the device: the one read
  const int64_t cols = std::min<int64_t>(o.cols, n);
  const int64_t rows = (n + o.cols - 1) / o.cols;
  const int64_t tw = w * o.scale, th = h * o.scale;
  if (!o.row_labels.empty() && (o.label_scale < 1 || o.label_scale > 8)) {
    throw std::runtime_error("make_grid: label_scale " + std::to_string(o.label_scale) + " not in 1..8");
  }
  int64_t label_w = 0;  // the label column, left of the tiles
  for (const std::string& l : o.row_labels) {
    label_w = std::max<int64_t>(label_w, text_width(l.substr(0, 64), o.label_scale) + 2 * o.padding + 2);
  }
  const int64_t gw = label_w + cols * tw + (cols + 1) * o.padding, gh = rows * th + (rows + 1) * o.padding;
  if (gw > 100000 || gh > 100000) throw std::runtime_error("make_grid: a " + std::to_string(gw) + "x" + std::to_string(gh) + " grid is too large");
  Image img(static_cast<int>(gw), static_cast<int>(gh), static_cast<int>(c), o.background);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x0 = label_w + o.padding + (i % o.cols) * (tw + o.padding);
    const int64_t y0 = o.padding + (i / o.cols) * (th + o.padding);
    for (int64_t y = 0; y < th; ++y) {
      for (int64_t x = 0; x < tw; ++x) {
        uint8_t* px = img.at(static_cast<int>(x0 + x), static_cast<int>(y0 + y));
        for (int64_t ch = 0; ch < c; ++ch) {
          px[ch] = to_pixel(v[((i * c + ch) * h + y / o.scale) * w + x / o.scale]);
        }
      }
    }
  }
  const uint8_t ink = o.background < 128 ? 255 : 0;
  for (std::size_t r = 0; r < o.row_labels.size() && static_cast<int64_t>(r) < rows; ++r) {
    const int64_t y = o.padding + static_cast<int64_t>(r) * (th + o.padding) + (th - 7 * o.label_scale) / 2;
    draw_text(img, o.padding + 1, static_cast<int>(y), o.row_labels[r].substr(0, 64), Rgb{ink, ink, ink}, o.label_scale);
  }
  return img;
}

void save_grid(const std::string& path, const flame::Tensor& images, const GridOptions& options) {
  write_image(path, make_grid(images, options));
}

void save_grid_png(const std::string& path, const flame::Tensor& images, const GridOptions& options) {
  write_png(path, make_grid(images, options));
}

}  // namespace flame_diffusion
