#pragma once
// 8-bit PNG writing through libpng, JPEG through libjpeg(-turbo), and sample grids: a batch of
// generated images in [-1, 1] tiled into one picture.
//
//   save_grid_png("runs/x/samples.png", samples, {.cols = 10, .padding = 2, .scale = 2});
//
// libpng reports errors by longjmp; write_png turns them into std::runtime_error naming the file
// (Note [libpng errors] in png_image.cpp), writes to <path>.tmp and renames, so a reader never sees a
// half-written PNG.
#include <cstdint>
#include <string>
#include <vector>

#include <flame/flame.h>

namespace flame_diffusion {

// An 8-bit image, rows top to bottom, channels interleaved (1: gray, 3: RGB).
struct Image {
  int width = 0, height = 0, channels = 1;
  std::vector<uint8_t> pixels;  // height * width * channels

  Image() = default;
  Image(int w, int h, int c, uint8_t fill = 0);
  uint8_t* at(int x, int y) { return pixels.data() + (static_cast<std::size_t>(y) * width + x) * channels; }
  const uint8_t* at(int x, int y) const {
    return pixels.data() + (static_cast<std::size_t>(y) * width + x) * channels;
  }
};

// Writes `image` as an 8-bit gray or RGB PNG. Raises std::runtime_error (naming `path`) on a bad
// image or an I/O or libpng error.
void write_png(const std::string& path, const Image& image);
// The same as a baseline JPEG of `quality` (1..100), written to <path>.tmp and renamed. Raises when
// the build has no libjpeg (jpeg_supported() is false).
void write_jpeg(const std::string& path, const Image& image, int quality = 95);
bool jpeg_supported();

enum class ImageFormat { png, jpeg };
// By the path's extension, case-insensitive: .png, or .jpg / .jpeg; any other (or none) raises an
// error naming `flag` and the path.
ImageFormat image_format_of(const std::string& path, const std::string& flag);
// write_png or write_jpeg by the extension.
void write_image(const std::string& path, const Image& image);
// For an output written after a long computation: the extension is supported, the path is not a
// folder and its folder exists; raises naming `flag` otherwise (check before the work).
void check_output_image_path(const std::string& path, const std::string& flag);

struct GridOptions {
  int cols = 10;           // tiles per row; the row count follows from the image count
  int padding = 2;         // pixels between tiles and around the border
  int scale = 1;           // each pixel becomes scale x scale (1, 2, 3 ...; nearest neighbour)
  uint8_t background = 0;  // padding colour (gray level, all channels)
  // Text left of each row (e.g. the class names of a class-per-row sample grid), in the plot's
  // bitmap font, white on a dark background and black on a light one. Empty: no label column.
  std::vector<std::string> row_labels;
  int label_scale = 1;
};

// Tiles images [N, C, H, W] (C = 1 or 3; values in [-1, 1], clamped; any device and floating
// dtype: read with to_vec) in row-major order: image i goes to row i / cols, column i % cols.
Image make_grid(const flame::Tensor& images, const GridOptions& options = {});
// make_grid then write_image (the format by the extension).
void save_grid(const std::string& path, const flame::Tensor& images, const GridOptions& options = {});
// make_grid then write_png.
void save_grid_png(const std::string& path, const flame::Tensor& images, const GridOptions& options = {});

// [-1, 1] -> [0, 255]: round((x + 1) * 127.5), clamped (NaN -> 0).
uint8_t to_pixel(float x);

}  // namespace flame_diffusion
