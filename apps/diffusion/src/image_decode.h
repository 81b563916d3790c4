#pragma once
// Reading training images: JPEG (libjpeg-turbo), PNG (libpng) and WebP (libwebp) into 8-bit RGB,
// and the antialiased resize the image data set uses (image_dataset.h).
//
//   Image rgb = decode_image("photos/cat.jpg");        // RGB, EXIF orientation applied
//   ImageInfo info = read_image_info("photos/cat.jpg"); // the size only (headers, EXIF)
//
// The format is told by the file's first bytes, not its name, so a random file named .png is
// refused as "not a JPEG, PNG or WebP file". A decoder's error or warning (a truncated JPEG makes
// libjpeg warn and pad the rest gray) raises ImageDecodeError naming the file: a training image
// that does not decode cleanly is not used.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "png_image.h"

namespace flame_diffusion {

class ImageDecodeError : public std::runtime_error {
 public:
  explicit ImageDecodeError(const std::string& what) : std::runtime_error(what) {}
};

enum class ImageFileFormat { jpeg, png, webp };
const char* image_file_format_name(ImageFileFormat format);

struct ImageInfo {
  int width = 0, height = 0;  // after EXIF orientation (5..8 swap the stored sides)
  ImageFileFormat format = ImageFileFormat::png;
  int exif_orientation = 1;  // 1..8 (JPEG's EXIF tag 0x0112); 1 for PNG and WebP
};

// Whether this build decodes the format (JPEG and WebP are optional at configure time).
bool image_format_supported(ImageFileFormat format);

// The format by the leading bytes (FF D8 FF; 89 P N G; RIFF....WEBP); raises naming `what`.
ImageFileFormat sniff_image_format(const uint8_t* data, size_t size, const std::string& what);

// Reads the headers only. Raises ImageDecodeError naming the file.
ImageInfo read_image_info(const std::string& path);
// The whole image as 8-bit RGB (gray expanded, palette expanded, 16-bit reduced to 8, alpha
// dropped as PIL's convert("RGB") does), JPEG's EXIF orientation applied (as PIL's
// ImageOps.exif_transpose). Raises ImageDecodeError naming the file.
Image decode_image(const std::string& path);
// From bytes in memory; `what` names them in errors.
Image decode_image_bytes(const std::vector<uint8_t>& bytes, const std::string& what);

// Applies EXIF orientation 1..8 to an image (2: mirror, 3: rotate 180, 4: flip, 5: transpose,
// 6: rotate 90° clockwise, 7: transverse, 8: rotate 90° counter-clockwise).
Image apply_exif_orientation(const Image& image, int orientation);
// The orientation tag of a JPEG's APP1 "Exif" segment payload (the bytes after the marker length);
// 1 when absent or malformed.
int exif_orientation_of(const uint8_t* app1, size_t size);

// Note [Lanczos resize]
// Separable Lanczos-3 resampling as PIL's Image.resize(size, Image.LANCZOS) computes it: for an
// output of n samples from m, scale = m / n, the kernel is widened by max(scale, 1) when shrinking
// (that is the antialiasing: the filter's cut-off follows the output's sample rate), output sample
// i is centred at (i + 0.5) * scale in input coordinates, taps run over
// [trunc(centre - support + 0.5), trunc(centre + support + 0.5)) clipped to the image, with
// support = 3 * max(scale, 1), and the weights are normalised to sum to 1. The horizontal pass
// runs first, then the vertical one, in double without rounding between them (PIL's mode "F"; its
// 8-bit modes round each pass). The result is not clamped (Lanczos overshoots at edges).
//
// The taps of output samples [first, first + count) of an n-sample resize from m samples:
struct ResampleTaps {
  std::vector<int> start;      // first input index of each output sample
  std::vector<int> count;      // taps of each output sample
  std::vector<double> weights;  // `max_taps` per output sample, normalised
  int max_taps = 0;
};
ResampleTaps lanczos_taps(int in_size, int out_size, int first, int count);

// Resizes float pixels [height, width, channels] (interleaved) to out_w x out_h and returns the
// window [x0, x0 + crop_w) x [y0, y0 + crop_h) of the result as [crop_h, crop_w, channels]; only
// that window is computed. With mirror, the window's columns come out right to left.
std::vector<float> resize_lanczos_window(const float* src, int width, int height, int channels, int out_w,
                                         int out_h, int x0, int y0, int crop_w, int crop_h, bool mirror = false);
// The same from 8-bit pixels (a decoded Image), with no float copy of the whole input.
std::vector<float> resize_lanczos_window(const uint8_t* src, int width, int height, int channels, int out_w,
                                         int out_h, int x0, int y0, int crop_w, int crop_h, bool mirror = false);

}  // namespace flame_diffusion
