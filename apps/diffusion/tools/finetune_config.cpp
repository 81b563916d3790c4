// The fine-tuning configuration and data set, checked without training:
//
//   finetune_config --keys                               every key, its default and what it does
//   finetune_config lora.toml --set train.steps=2000     the resolved configuration, as TOML
//   finetune_config lora.toml --scan                     ... and the data set's scan and buckets
//   finetune_config lora.toml --out runs/x               writes runs/x/config.toml
#include <iostream>

#include <CLI/CLI.hpp>

#include "image_dataset.h"
#include "train_config.h"

int main(int argc, char** argv) {
  CLI::App app("Check a flame-diffusion fine-tuning configuration (TOML) and its data set");
  std::string path, out_dir;
  std::vector<std::string> overrides;
  bool keys = false, scan = false;
  app.add_option("config", path, "the configuration file (TOML); none: the defaults");
  app.add_option("--set", overrides, "key=value overrides, applied after the file (repeatable)");
  app.add_flag("--keys", keys, "list every key with its default and description");
  app.add_flag("--scan", scan, "scan the data set and print its buckets");
  app.add_option("--out", out_dir, "write the resolved configuration to <dir>/config.toml");
  CLI11_PARSE(app, argc, argv);
  try {
    if (keys) {
      std::cout << flame_diffusion::finetune_config_help();
      return 0;
    }
    const flame_diffusion::FinetuneConfig config = flame_diffusion::load_finetune_config(path, overrides);
    if (scan) (void)flame_diffusion::ImageDataset::scan(config.dataset);
    if (!out_dir.empty()) {
      std::cout << "wrote " << flame_diffusion::save_finetune_config(config, out_dir) << "\n";
    } else {
      std::cout << flame_diffusion::finetune_config_to_toml(config);
    }
  } catch (const std::exception& e) {
    std::cerr << "finetune_config: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
