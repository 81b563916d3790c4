// JPEG, PNG and WebP decoding into 8-bit RGB, EXIF orientation, and the Lanczos resize (image_decode.h).
#include "image_decode.h"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#if FLAME_DIFFUSION_HAVE_JPEG
#include <jpeglib.h>
#endif
#if FLAME_DIFFUSION_HAVE_WEBP
#include <webp/decode.h>
#endif

namespace flame_diffusion {
namespace {

std::vector<uint8_t> read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ImageDecodeError(path + ": cannot open (" + std::strerror(errno) + ")");
  std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw ImageDecodeError(path + ": read error");
  return bytes;
}

// ---- JPEG ----
#if FLAME_DIFFUSION_HAVE_JPEG
// libjpeg's error_exit must not return (Note [libpng errors] in png_image.cpp): the message is
// copied out and the decode function longjmps back to a frame without C++ objects in between. A
// warning (corrupt data, premature end of file) takes the same way out: libjpeg would go on and
// pad the image with gray, which is not a training image.
struct JpegReadError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {0};
};

void on_jpeg_read_error(j_common_ptr cinfo) {
  auto* st = reinterpret_cast<JpegReadError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, st->message);
  std::longjmp(st->jump, 1);
}

void on_jpeg_read_message(j_common_ptr cinfo, int level) {
  if (level < 0) on_jpeg_read_error(cinfo);  // a warning: treated as an error
}

struct JpegResult {
  int width = 0, height = 0, orientation = 1;
};

// Header only when `pixels` is null; else the RGB pixels too (pixels sized width * height * 3 by
// the caller's resize callback). Returns false with err->message set on failure.
bool jpeg_decode(const uint8_t* data, size_t size, JpegResult* out, std::vector<uint8_t>* pixels, JpegReadError* err) {
  jpeg_decompress_struct cinfo;
  cinfo.err = jpeg_std_error(&err->mgr);
  err->mgr.error_exit = on_jpeg_read_error;
  err->mgr.emit_message = on_jpeg_read_message;
  if (setjmp(err->jump)) {
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  jpeg_create_decompress(&cinfo);
  jpeg_mem_src(&cinfo, data, static_cast<unsigned long>(size));
  jpeg_save_markers(&cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&cinfo, TRUE);
  out->orientation = 1;
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    if (m->marker == JPEG_APP0 + 1) {
      const int o = exif_orientation_of(m->data, m->data_length);
      if (o != 1) out->orientation = o;
    }
  }
  out->width = static_cast<int>(cinfo.image_width);
  out->height = static_cast<int>(cinfo.image_height);
  if (pixels == nullptr) {
    jpeg_destroy_decompress(&cinfo);
    return true;
  }
  if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
    std::snprintf(err->message, sizeof err->message, "CMYK JPEGs are not supported (convert it to RGB)");
    jpeg_destroy_decompress(&cinfo);
    return false;
  }
  cinfo.out_color_space = JCS_RGB;
  jpeg_start_decompress(&cinfo);
  // The buffer was sized from the header by the caller; rows are written straight into it.
  while (cinfo.output_scanline < cinfo.output_height) {
    JSAMPROW row = pixels->data() + static_cast<size_t>(cinfo.output_scanline) * cinfo.output_width * 3;
    jpeg_read_scanlines(&cinfo, &row, 1);
  }
  jpeg_finish_decompress(&cinfo);
  jpeg_destroy_decompress(&cinfo);
  return true;
}

JpegResult jpeg_info(const uint8_t* data, size_t size, const std::string& what) {
  JpegReadError err;
  JpegResult r;
  if (!jpeg_decode(data, size, &r, nullptr, &err)) throw ImageDecodeError(what + ": corrupt JPEG (libjpeg: " + err.message + ")");
  return r;
}
#endif

// ---- PNG: libpng's simplified API reports errors in png_image::message, no longjmp to manage ----
Image png_decode(const uint8_t* data, size_t size, const std::string& what, bool header_only) {
  png_image img;
  std::memset(&img, 0, sizeof img);
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, data, size))
    throw ImageDecodeError(what + ": corrupt PNG (libpng: " + img.message + ")");
  Image out;
  out.width = static_cast<int>(img.width);
  out.height = static_cast<int>(img.height);
  out.channels = 3;
  if (header_only) {
    png_image_free(&img);
    return out;
  }
  // RGBA, then the alpha dropped: the colour values stay as stored (PIL's convert("RGB")), where
  // decoding to RGB would composite them onto black.
  img.format = PNG_FORMAT_RGBA;
  std::vector<uint8_t> rgba(PNG_IMAGE_SIZE(img));
  if (!png_image_finish_read(&img, nullptr, rgba.data(), 0, nullptr))
    throw ImageDecodeError(what + ": corrupt PNG (libpng: " + img.message + ")");
  out.pixels.resize(static_cast<size_t>(out.width) * out.height * 3);
  for (size_t i = 0, n = static_cast<size_t>(out.width) * out.height; i < n; ++i) {
    std::memcpy(&out.pixels[i * 3], &rgba[i * 4], 3);
  }
  return out;
}

void check_size(int width, int height, const std::string& what) {
  // 2^28 pixels (16384 x 16384) is far beyond any training resolution; larger sizes are more
  // likely a corrupt header than a photograph, and would ask for gigabytes.
  if (width <= 0 || height <= 0 || static_cast<int64_t>(width) * height > (int64_t{1} << 28))
    throw ImageDecodeError(what + ": image size " + std::to_string(width) + "x" + std::to_string(height) +
                           " is empty or larger than 2^28 pixels");
}

[[noreturn]] void unsupported(ImageFileFormat f, const std::string& what) {
  throw ImageDecodeError(what + ": " + image_file_format_name(f) + " is not supported by this build (" +
                         (f == ImageFileFormat::jpeg ? "libjpeg-dev" : "libwebp-dev") +
                         " was not found when it was configured; scripts/setup_deps.sh installs it)");
}

uint32_t read_u16(const uint8_t* p, bool little) { return little ? p[0] | (p[1] << 8) : (p[0] << 8) | p[1]; }
uint32_t read_u32(const uint8_t* p, bool little) {
  return little ? p[0] | (p[1] << 8) | (p[2] << 16) | (uint32_t{p[3]} << 24)
                : (uint32_t{p[0]} << 24) | (p[1] << 16) | (p[2] << 8) | p[3];
}

double lanczos3(double x) {
  if (x <= -3.0 || x >= 3.0) return 0.0;
  auto sinc = [](double v) {
    if (v == 0.0) return 1.0;
    v *= M_PI;
    return std::sin(v) / v;
  };
  return sinc(x) * sinc(x / 3.0);
}

}  // namespace

const char* image_file_format_name(ImageFileFormat format) {
  switch (format) {
    case ImageFileFormat::jpeg: return "JPEG";
    case ImageFileFormat::png: return "PNG";
    case ImageFileFormat::webp: return "WebP";
  }
  return "?";
}

bool image_format_supported(ImageFileFormat format) {
  switch (format) {
    case ImageFileFormat::png: return true;
#if FLAME_DIFFUSION_HAVE_JPEG
    case ImageFileFormat::jpeg: return true;
#endif
#if FLAME_DIFFUSION_HAVE_WEBP
    case ImageFileFormat::webp: return true;
#endif
    default: return false;
  }
}

ImageFileFormat sniff_image_format(const uint8_t* d, size_t n, const std::string& what) {
  if (n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) return ImageFileFormat::jpeg;
  static const uint8_t png_sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (n >= 8 && std::memcmp(d, png_sig, 8) == 0) return ImageFileFormat::png;
  if (n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0) return ImageFileFormat::webp;
  throw ImageDecodeError(what + ": not a JPEG, PNG or WebP file (" + std::to_string(n) +
                         " bytes, none of their signatures at the start)");
}

int exif_orientation_of(const uint8_t* p, size_t n) {
  // "Exif\0\0", then a TIFF header: byte order (II / MM), 42, the offset of IFD0 from the header.
  if (n < 14 || std::memcmp(p, "Exif\0\0", 6) != 0) return 1;
  const uint8_t* tiff = p + 6;
  const size_t len = n - 6;
  bool little;
  if (tiff[0] == 'I' && tiff[1] == 'I') little = true;
  else if (tiff[0] == 'M' && tiff[1] == 'M') little = false;
  else return 1;
  if (read_u16(tiff + 2, little) != 42) return 1;
  const size_t ifd = read_u32(tiff + 4, little);
  if (ifd + 2 > len) return 1;
  const size_t entries = read_u16(tiff + ifd, little);
  for (size_t e = 0; e < entries; ++e) {
    const size_t at = ifd + 2 + e * 12;
    if (at + 12 > len) return 1;
    if (read_u16(tiff + at, little) != 0x0112) continue;
    if (read_u16(tiff + at + 2, little) != 3) return 1;  // SHORT
    const uint32_t v = read_u16(tiff + at + 8, little);
    return v >= 1 && v <= 8 ? static_cast<int>(v) : 1;
  }
  return 1;
}

Image apply_exif_orientation(const Image& in, int o) {
  if (o <= 1 || o > 8) return in;
  const int W = in.width, H = in.height, C = in.channels;
  const bool swap = o >= 5;
  Image out(swap ? H : W, swap ? W : H, C);
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      int sx = x, sy = y;
      switch (o) {
        case 2: sx = W - 1 - x; break;
        case 3: sx = W - 1 - x; sy = H - 1 - y; break;
        case 4: sy = H - 1 - y; break;
        case 5: sx = y; sy = x; break;
        case 6: sx = y; sy = H - 1 - x; break;
        case 7: sx = W - 1 - y; sy = H - 1 - x; break;
        case 8: sx = W - 1 - y; sy = x; break;
      }
      std::memcpy(out.at(x, y), in.at(sx, sy), C);
    }
  }
  return out;
}

ImageInfo read_image_info(const std::string& path) {
  const std::vector<uint8_t> bytes = read_file_bytes(path);
  ImageInfo info;
  info.format = sniff_image_format(bytes.data(), bytes.size(), path);
  if (!image_format_supported(info.format)) unsupported(info.format, path);
  switch (info.format) {
    case ImageFileFormat::jpeg: {
#if FLAME_DIFFUSION_HAVE_JPEG
      const JpegResult r = jpeg_info(bytes.data(), bytes.size(), path);
      info.exif_orientation = r.orientation;
      info.width = r.orientation >= 5 ? r.height : r.width;
      info.height = r.orientation >= 5 ? r.width : r.height;
#endif
      break;
    }
    case ImageFileFormat::png: {
      const Image h = png_decode(bytes.data(), bytes.size(), path, true);
      info.width = h.width;
      info.height = h.height;
      break;
    }
    case ImageFileFormat::webp: {
#if FLAME_DIFFUSION_HAVE_WEBP
      if (!WebPGetInfo(bytes.data(), bytes.size(), &info.width, &info.height))
        throw ImageDecodeError(path + ": corrupt WebP (libwebp could not read its header)");
#endif
      break;
    }
  }
  check_size(info.width, info.height, path);
  return info;
}

Image decode_image(const std::string& path) { return decode_image_bytes(read_file_bytes(path), path); }

Image decode_image_bytes(const std::vector<uint8_t>& bytes, const std::string& what) {
  const ImageFileFormat format = sniff_image_format(bytes.data(), bytes.size(), what);
  if (!image_format_supported(format)) unsupported(format, what);
  Image out;
  out.channels = 3;
  switch (format) {
    case ImageFileFormat::jpeg: {
#if FLAME_DIFFUSION_HAVE_JPEG
      const JpegResult r = jpeg_info(bytes.data(), bytes.size(), what);
      check_size(r.width, r.height, what);
      out.width = r.width;
      out.height = r.height;
      out.pixels.resize(static_cast<size_t>(r.width) * r.height * 3);
      JpegReadError err;
      JpegResult again;
      if (!jpeg_decode(bytes.data(), bytes.size(), &again, &out.pixels, &err))
        throw ImageDecodeError(what + ": corrupt JPEG (libjpeg: " + err.message + ")");
      if (r.orientation != 1) out = apply_exif_orientation(out, r.orientation);
#endif
      break;
    }
    case ImageFileFormat::png: {
      const Image h = png_decode(bytes.data(), bytes.size(), what, true);
      check_size(h.width, h.height, what);
      out = png_decode(bytes.data(), bytes.size(), what, false);
      break;
    }
    case ImageFileFormat::webp: {
#if FLAME_DIFFUSION_HAVE_WEBP
      int w = 0, h = 0;
      if (!WebPGetInfo(bytes.data(), bytes.size(), &w, &h))
        throw ImageDecodeError(what + ": corrupt WebP (libwebp could not read its header)");
      check_size(w, h, what);
      out.width = w;
      out.height = h;
      out.pixels.resize(static_cast<size_t>(w) * h * 3);
      if (WebPDecodeRGBInto(bytes.data(), bytes.size(), out.pixels.data(), out.pixels.size(), w * 3) == nullptr)
        throw ImageDecodeError(what + ": corrupt WebP (libwebp could not decode it)");
#endif
      break;
    }
  }
  return out;
}

ResampleTaps lanczos_taps(int in_size, int out_size, int first, int count) {
  ResampleTaps t;
  t.start.resize(count);
  t.count.resize(count);
  if (in_size == out_size) {  // no resampling: each output sample is its input sample
    t.max_taps = 1;
    t.weights.assign(count, 1.0);
    for (int i = 0; i < count; ++i) {
      t.start[i] = first + i;
      t.count[i] = 1;
    }
    return t;
  }
  const double scale = static_cast<double>(in_size) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = 3.0 * filter_scale;
  t.max_taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  t.weights.assign(static_cast<size_t>(count) * t.max_taps, 0.0);
  for (int i = 0; i < count; ++i) {
    const double center = (first + i + 0.5) * scale;
    const int lo = std::max(static_cast<int>(center - support + 0.5), 0);
    const int hi = std::min(static_cast<int>(center + support + 0.5), in_size);
    const int n = std::min(hi - lo, t.max_taps);
    double* w = &t.weights[static_cast<size_t>(i) * t.max_taps];
    double sum = 0.0;
    for (int k = 0; k < n; ++k) {
      w[k] = lanczos3((k + lo - center + 0.5) / filter_scale);
      sum += w[k];
    }
    if (sum != 0.0) {
      for (int k = 0; k < n; ++k) w[k] /= sum;
    }
    t.start[i] = lo;
    t.count[i] = n;
  }
  return t;
}

namespace {

template <class T>
std::vector<float> resize_window(const T* src, int width, int height, int C, int out_w, int out_h, int x0, int y0,
                                 int crop_w, int crop_h, bool mirror) {
  if (width <= 0 || height <= 0 || C <= 0 || out_w <= 0 || out_h <= 0 || crop_w <= 0 || crop_h <= 0 || x0 < 0 ||
      y0 < 0 || x0 + crop_w > out_w || y0 + crop_h > out_h)
    throw std::invalid_argument("resize_lanczos_window: window " + std::to_string(crop_w) + "x" +
                                std::to_string(crop_h) + " at (" + std::to_string(x0) + ", " + std::to_string(y0) +
                                ") of a " + std::to_string(width) + "x" + std::to_string(height) + " -> " +
                                std::to_string(out_w) + "x" + std::to_string(out_h) + " resize is out of bounds");
  const ResampleTaps hx = lanczos_taps(width, out_w, x0, crop_w);
  const ResampleTaps vy = lanczos_taps(height, out_h, y0, crop_h);
  int row_lo = height, row_hi = 0;
  for (int i = 0; i < crop_h; ++i) {
    row_lo = std::min(row_lo, vy.start[i]);
    row_hi = std::max(row_hi, vy.start[i] + vy.count[i]);
  }
  // Horizontal pass over the rows the vertical taps read, then the vertical pass (PIL's order).
  const int rows = row_hi - row_lo;
  std::vector<double> mid(static_cast<size_t>(rows) * crop_w * C);
  for (int r = 0; r < rows; ++r) {
    const T* in_row = src + static_cast<size_t>(row_lo + r) * width * C;
    for (int i = 0; i < crop_w; ++i) {
      const double* w = &hx.weights[static_cast<size_t>(i) * hx.max_taps];
      const T* in = in_row + static_cast<size_t>(hx.start[i]) * C;
      double* o = &mid[(static_cast<size_t>(r) * crop_w + (mirror ? crop_w - 1 - i : i)) * C];
      for (int c = 0; c < C; ++c) {
        double s = 0.0;
        for (int k = 0; k < hx.count[i]; ++k) s += w[k] * in[static_cast<size_t>(k) * C + c];
        o[c] = s;
      }
    }
  }
  std::vector<float> out(static_cast<size_t>(crop_h) * crop_w * C);
  const size_t row_len = static_cast<size_t>(crop_w) * C;
  for (int j = 0; j < crop_h; ++j) {
    const double* w = &vy.weights[static_cast<size_t>(j) * vy.max_taps];
    const double* in = &mid[static_cast<size_t>(vy.start[j] - row_lo) * row_len];
    float* o = &out[static_cast<size_t>(j) * row_len];
    for (size_t e = 0; e < row_len; ++e) {
      double s = 0.0;
      for (int k = 0; k < vy.count[j]; ++k) s += w[k] * in[static_cast<size_t>(k) * row_len + e];
      o[e] = static_cast<float>(s);
    }
  }
  return out;
}

}  // namespace

std::vector<float> resize_lanczos_window(const float* src, int width, int height, int channels, int out_w, int out_h,
                                         int x0, int y0, int crop_w, int crop_h, bool mirror) {
  return resize_window(src, width, height, channels, out_w, out_h, x0, y0, crop_w, crop_h, mirror);
}

std::vector<float> resize_lanczos_window(const uint8_t* src, int width, int height, int channels, int out_w,
                                         int out_h, int x0, int y0, int crop_w, int crop_h, bool mirror) {
  return resize_window(src, width, height, channels, out_w, out_h, x0, y0, crop_w, crop_h, mirror);
}

}  // namespace flame_diffusion
