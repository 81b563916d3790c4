#include "models/pipelines.h"

#include <algorithm>
#include <filesystem>
#include <string>
#include <utility>

#include <flame/error.h>

#include "models/lora_file.h"
#include "models/text_checkpoint.h"
#include "models/unet2d_convert.h"

namespace flame_diffusion::models {

using flame::Device;
using flame::DType;
using flame::Tensor;
namespace fs = std::filesystem;

namespace {

constexpr const char* kLoad = "load_pipeline";
constexpr const char* kGenerate = "generate";

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const std::string& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string family_of_class(const std::string& cls) {
  if (cls == "FluxPipeline") return "flux";
  if (cls == "StableDiffusion3Pipeline") return "sd3";
  if (cls == "StableDiffusionXLPipeline") return "sdxl";
  return "";
}

// A component folder of the pipeline, which must exist.
std::string component(const PipelineLoadOptions& o, const std::string& name, const std::string& family,
                      const std::string& replace_flag = "") {
  const fs::path p = fs::path(o.path) / name;
  FLAME_CHECK(fs::is_directory(p), kLoad, "the ", family, " pipeline folder ", o.path, " has no ", name,
              "/ folder", replace_flag.empty() ? std::string() : " (or give the component with " + replace_flag + ")");
  return p.string();
}

// The tokenizer's model_max_length (tokenizer_config.json), at most the encoder's positions.
int64_t tokenizer_max_length(const std::string& dir, int64_t positions) {
  const fs::path cfg = fs::path(dir) / "tokenizer_config.json";
  double n = 77;
  if (fs::is_regular_file(cfg)) n = JsonConfig::from_file(cfg.string()).get_double("model_max_length", 77.0);
  return std::min<int64_t>(static_cast<int64_t>(std::min(n, 1e9)), positions);
}

std::shared_ptr<ClipTextModel> load_clip(const PipelineLoadOptions& o, const std::string& override_path,
                                         const std::string& subfolder, const std::string& family) {
  TextEncoderLoadOptions t{.device = o.device, .dtype = o.dtype};
  if (!override_path.empty()) {
    t.family = family;
    return load_clip_text(override_path, t);
  }
  t.subfolder = subfolder;
  return load_clip_text(component(o, subfolder, family), t);
}

ClipTokenizer clip_tokenizer(const PipelineLoadOptions& o, const std::string& subfolder, const std::string& family,
                             const ClipTextModel& model) {
  const std::string dir = component(o, subfolder, family);
  ClipTokenizerOptions t;
  t.max_length = tokenizer_max_length(dir, model.config().max_position_embeddings);
  return ClipTokenizer::from_folder(dir, t);
}

std::shared_ptr<T5EncoderModel> load_t5(const PipelineLoadOptions& o, const std::string& subfolder,
                                        const std::string& family) {
  TextEncoderLoadOptions t{.device = o.device, .dtype = o.dtype};
  if (!o.text_encoder_3.empty()) return load_t5_encoder(o.text_encoder_3, t);
  t.subfolder = subfolder;
  return load_t5_encoder(component(o, subfolder, family, "--t5"), t);
}

// [B, ...] -> [B * n, ...], each row n times in a row (diffusers' repeat + view).
Tensor repeat_rows(const Tensor& x, int64_t n) {
  if (n == 1) return x;
  flame::Shape expanded = x.sizes();
  expanded.insert(expanded.begin() + 1, n);
  flame::Shape out = x.sizes();
  out[0] *= n;
  return x.unsqueeze(1).expand(expanded).reshape(out);
}

struct ClipEmbeds {
  Tensor penultimate, pooled;  // [B, L, D]; the projection (SD3, SDXL's bigG) or the pooled output (FLUX)
};

ClipEmbeds encode_clip(ClipTextModel& model, const ClipTokenizer& tokenizer, const std::vector<std::string>& texts,
                       Device device, bool projected = true) {
  const TokenBatch b = tokenizer(texts);
  ClipTextOutput out = model.encode(b.input_ids.to(device), {.output_hidden_states = true});
  const auto n = out.hidden_states.size();
  return {out.hidden_states[n - 2], projected ? out.text_embeds : out.pooled};
}

Tensor encode_t5(T5EncoderModel& model, const T5Tokenizer& tokenizer, const std::vector<std::string>& texts,
                 Device device) {
  return model.encode(tokenizer(texts).input_ids.to(device));  // no attention mask, as diffusers
}

// cond + uncond halves of a CFG batch -> uncond + scale * (cond - uncond).
Tensor guide(const Tensor& both, double scale) {
  const int64_t n = both.size(0) / 2;
  const Tensor uncond = both.narrow(0, 0, n), cond = both.narrow(0, n, n);
  return uncond + (cond - uncond) * scale;
}

struct Conditioning {
  Tensor states, pooled, time_ids;  // [N or 2N, ...]; time_ids: SDXL only
};

using Encode = std::function<PromptEmbeddings(const std::vector<std::string>&)>;

// The prompts' embeddings, or with negative: the negative prompt's, one row per image.
Conditioning flux_conditioning(const Encode& encode, const GenerateOptions& o, bool negative = false) {
  const PromptEmbeddings e =
      encode(negative ? std::vector<std::string>(o.prompts.size(), *o.negative_prompt) : o.prompts);
  return {repeat_rows(e.states, o.images_per_prompt), repeat_rows(e.pooled, o.images_per_prompt), {}};
}

Conditioning sd3_conditioning(const Encode& encode, const GenerateOptions& o, bool cfg) {
  PromptEmbeddings e = encode(o.prompts);
  const Tensor states = repeat_rows(e.states, o.images_per_prompt), pooled = repeat_rows(e.pooled, o.images_per_prompt);
  if (!cfg) return {states, pooled, {}};
  const PromptEmbeddings n = encode(std::vector<std::string>(o.prompts.size(), o.negative_prompt.value_or("")));
  return {flame::cat({repeat_rows(n.states, o.images_per_prompt), states}, 0),
          flame::cat({repeat_rows(n.pooled, o.images_per_prompt), pooled}, 0), {}};
}

Conditioning sdxl_conditioning(const Pipeline& p, const Encode& encode, const GenerateOptions& o, bool cfg) {
  const PromptEmbeddings e = encode(o.prompts);
  const Tensor states = repeat_rows(e.states, o.images_per_prompt), pooled = repeat_rows(e.pooled, o.images_per_prompt);
  const auto h = static_cast<float>(o.height), w = static_cast<float>(o.width);
  const int64_t n = states.size(0);
  const Tensor ids = Tensor::from_vec(std::vector<float>{h, w, 0.0f, 0.0f, h, w}, {1, 6})
                         .to(states.dtype())
                         .to(states.device())
                         .expand({n, 6});
  if (!cfg) return {states, pooled, ids};
  Tensor nstates, npooled;
  if (!o.negative_prompt && p.force_zeros_for_empty_prompt) {
    nstates = Tensor::zeros(states.sizes(), {states.dtype(), states.device()});
    npooled = Tensor::zeros(pooled.sizes(), {pooled.dtype(), pooled.device()});
  } else {
    const PromptEmbeddings ne = encode(std::vector<std::string>(o.prompts.size(), o.negative_prompt.value_or("")));
    nstates = repeat_rows(ne.states, o.images_per_prompt);
    npooled = repeat_rows(ne.pooled, o.images_per_prompt);
  }
  return {flame::cat({nstates, states}, 0), flame::cat({npooled, pooled}, 0), flame::cat({ids, ids}, 0)};
}

int64_t latent_channels(const Pipeline& p) {
  if (p.flux) return p.flux->config().in_channels / 4;
  if (p.sd3) return p.sd3->config().in_channels;
  return p.unet->config().in_channels;
}

// The size multiple of an image side: the VAE factor, x2 for FLUX's packing, x patch for SD3.
int64_t size_multiple(const Pipeline& p) {
  const int64_t f = p.vae->config().downscale();
  if (p.flux) return 2 * f;
  if (p.sd3) return p.sd3->config().patch_size * f;
  return f;
}

}  // namespace

std::vector<std::string> pipeline_families() { return {"flux", "sd3", "sdxl"}; }

std::shared_ptr<Pipeline> load_pipeline(const PipelineLoadOptions& o) {
  FLAME_CHECK(!o.path.empty(), kLoad, "no pipeline folder given: a diffusers pipeline folder holds the tokenizers "
              "(model_index.json, tokenizer/, ...)");
  FLAME_CHECK(fs::is_directory(o.path), kLoad, o.path, " is not a folder; give a diffusers pipeline folder "
              "(model_index.json, scheduler/, tokenizer/, text_encoder/, vae/, transformer/ or unet/)");
  auto p = std::make_shared<Pipeline>();
  p->path = o.path;
  p->device = o.device;
  p->dtype = o.dtype;
  const fs::path index = fs::path(o.path) / "model_index.json";
  JsonConfig model_index;
  if (fs::is_regular_file(index)) model_index = JsonConfig::from_file(index.string());
  p->family = o.family;
  if (p->family.empty()) {
    FLAME_CHECK(model_index.has("_class_name"), kLoad, o.path,
                " has no model_index.json naming the pipeline class; give the family (", join(pipeline_families()), ")");
    const std::string cls = model_index.get_string("_class_name");
    p->family = family_of_class(cls);
    FLAME_CHECK(!p->family.empty(), kLoad, index.string(), ": _class_name \"", cls,
                "\" is not FluxPipeline, StableDiffusion3Pipeline or StableDiffusionXLPipeline");
  }
  const std::vector<std::string> fams = pipeline_families();
  FLAME_CHECK(std::find(fams.begin(), fams.end(), p->family) != fams.end(), kLoad, "unknown family \"", p->family,
              "\"; one of ", join(fams));
  const std::string& fam = p->family;
  p->force_zeros_for_empty_prompt = model_index.get_bool("force_zeros_for_empty_prompt", true);

  const fs::path sched = fs::path(o.path) / "scheduler" / "scheduler_config.json";
  const bool has_sched = fs::is_regular_file(sched);
  if (fam == "sdxl") {
    p->discrete_config = has_sched ? discrete_config_from_json(JsonConfig::from_file(sched.string()))
                                   : sdxl_scheduler_config();
  } else {
    p->flow_config = has_sched ? flow_match_config_from_json(JsonConfig::from_file(sched.string()))
                               : (fam == "flux" ? flux_scheduler_config() : sd3_scheduler_config());
  }

  VaeLoadOptions vo{.device = o.device, .dtype = o.dtype, .family = fam};
  p->vae = load_vae(o.vae.empty() ? component(o, "vae", fam, "--vae") : o.vae, vo);
  const std::string denoiser = o.denoiser;
  if (fam == "flux") {
    p->flux = load_flux(denoiser.empty() ? component(o, "transformer", fam, "--transformer") : denoiser,
                        {.device = o.device, .dtype = o.dtype, .float8 = o.denoiser_float8});
    p->clip_l = load_clip(o, o.text_encoder, "text_encoder", "clip-l");
    p->t5 = load_t5(o, "text_encoder_2", fam);
    p->tokenizer_t5 = T5Tokenizer::from_folder(component(o, "tokenizer_2", fam));
  } else if (fam == "sd3") {
    p->sd3 = load_sd3(denoiser.empty() ? component(o, "transformer", fam, "--transformer") : denoiser,
                      {.device = o.device, .dtype = o.dtype, .float8 = o.denoiser_float8});
    p->clip_l = load_clip(o, o.text_encoder, "text_encoder", "clip-l");
    p->clip_g = load_clip(o, o.text_encoder_2, "text_encoder_2", "clip-g");
    if (!o.text_encoder_3.empty() || fs::is_directory(fs::path(o.path) / "text_encoder_3")) {
      p->t5 = load_t5(o, "text_encoder_3", fam);
      p->tokenizer_t5 = T5Tokenizer::from_folder(component(o, "tokenizer_3", fam));
    }
  } else {
    UNetLoadOptions uo{.device = o.device, .dtype = o.dtype};
    if (!denoiser.empty()) uo.family = "sdxl";
    p->unet = load_unet(denoiser.empty() ? component(o, "unet", fam, "--unet") : denoiser, uo);
    p->clip_l = load_clip(o, o.text_encoder, "text_encoder", "clip-l");
    p->clip_g = load_clip(o, o.text_encoder_2, "text_encoder_2", "clip-g");
  }
  if (!o.lora.empty()) {
    flame::nn::Module& denoiser_model = p->flux   ? static_cast<flame::nn::Module&>(*p->flux)
                                        : p->sd3 ? static_cast<flame::nn::Module&>(*p->sd3)
                                                 : static_cast<flame::nn::Module&>(*p->unet);
    const LoraFamily lf = fam == "flux" ? LoraFamily::kFlux : fam == "sd3" ? LoraFamily::kSD3 : LoraFamily::kSDXL;
    p->lora_skipped = load_lora(o.lora, denoiser_model, lf).skipped;
  }
  p->tokenizer_l = clip_tokenizer(o, "tokenizer", fam, *p->clip_l);
  if (p->clip_g) p->tokenizer_g = clip_tokenizer(o, "tokenizer_2", fam, *p->clip_g);
  if (fam == "sdxl" || fam == "sd3") {
    FLAME_CHECK(p->clip_g->config().with_projection, kLoad, fam, ": text_encoder_2 has no text_projection (the ",
                "pooled embedding is its projection); is it the bigG encoder?");
  }
  if (fam == "sd3") {
    FLAME_CHECK(p->clip_l->config().with_projection, kLoad, "sd3: text_encoder (CLIP-L) has no text_projection (SD3 ",
                "pools its projection); give SD3's CLIP-L (CLIPTextModelWithProjection)");
  }
  return p;
}

GenerateOptions resolve_generate_options(const Pipeline& p, GenerateOptions o) {
  const std::string& fam = p.family;
  FLAME_CHECK(!o.prompts.empty(), kGenerate, "no prompt given");
  // FLUX.1-schnell (no guidance embedding) is distilled to 4 steps over 256 T5 tokens.
  const bool schnell = p.flux && !p.flux->config().guidance_embeds;
  if (o.steps == 0) o.steps = fam == "sdxl" ? 30 : schnell ? 4 : 28;
  FLAME_CHECK(o.steps >= 1 && o.steps <= 1000, kGenerate, "steps is ", o.steps, "; give 1 to 1000");
  if (o.guidance == 0) o.guidance = fam == "flux" ? 3.5 : fam == "sd3" ? 7.0 : 5.0;
  FLAME_CHECK(o.guidance >= 0 && o.guidance <= 100, kGenerate, "guidance is ", o.guidance, "; give 0 to 100");
  FLAME_CHECK(o.true_cfg_scale >= 0 && o.true_cfg_scale <= 100, kGenerate, "true_cfg_scale is ", o.true_cfg_scale,
              "; give 0 to 100 (1: no true CFG)");
  FLAME_CHECK(fam == "flux" || o.true_cfg_scale == 1.0, kGenerate, "true_cfg_scale ", o.true_cfg_scale,
              " is FLUX's; ", fam, "'s classifier-free guidance scale is `guidance`");
  FLAME_CHECK(fam != "flux" || !o.negative_prompt || o.true_cfg_scale > 1.0, kGenerate,
              "FLUX uses a negative prompt only for true classifier-free guidance: give true_cfg_scale > 1 "
              "(e.g. 4; each step then runs the transformer twice), or no negative prompt");
  FLAME_CHECK(fam != "flux" || o.true_cfg_scale <= 1.0 || o.negative_prompt, kGenerate, "true_cfg_scale ",
              o.true_cfg_scale, " needs a negative prompt (\"\" is one), as FluxPipeline's true CFG does");
  if (fam == "sdxl") {
    if (o.sampler.empty()) o.sampler = "euler";
    const std::vector<std::string> names = discrete_sampler_names();
    FLAME_CHECK(std::find(names.begin(), names.end(), o.sampler) != names.end(), kGenerate, "sampler \"", o.sampler,
                "\" is not an SDXL sampler; one of ", join(names));
  } else {
    if (o.sampler.empty()) o.sampler = "euler";
    FLAME_CHECK(o.sampler == "euler", kGenerate, "sampler \"", o.sampler, "\": ", fam,
                " samples with the flow-match Euler scheduler (\"euler\")");
  }
  if (o.width == 0) o.width = 1024;
  if (o.height == 0) o.height = 1024;
  const int64_t m = size_multiple(p);
  FLAME_CHECK(o.width > 0 && o.height > 0 && o.width % m == 0 && o.height % m == 0, kGenerate, "width ", o.width,
              " and height ", o.height, " must be positive multiples of ", m, " for this ", fam, " pipeline");
  FLAME_CHECK(o.images_per_prompt >= 1, kGenerate, "images per prompt is ", o.images_per_prompt, "; give 1 or more");
  if (o.max_sequence_length == 0) o.max_sequence_length = fam == "flux" && !schnell ? 512 : 256;
  FLAME_CHECK(o.max_sequence_length >= 1 && o.max_sequence_length <= 512, kGenerate, "max_sequence_length is ",
              o.max_sequence_length, "; give 1 to 512");
  if (o.latents.defined()) {
    const int64_t f = p.vae->config().downscale();
    const flame::Shape want = {static_cast<int64_t>(o.prompts.size()) * o.images_per_prompt, latent_channels(p),
                               o.height / f, o.width / f};
    FLAME_CHECK(o.latents.sizes() == want, kGenerate, "latents of shape ", o.latents.sizes(), " given; this run needs ",
                want);
  }
  return o;
}

PromptEmbeddings encode_prompts(Pipeline& p, const std::vector<std::string>& texts, int64_t max_sequence_length) {
  flame::NoGradGuard no_grad;
  FLAME_CHECK(!texts.empty(), kGenerate, "encode_prompts: no text given");
  FLAME_CHECK(max_sequence_length >= 1 && max_sequence_length <= 512, kGenerate, "max_sequence_length is ",
              max_sequence_length, "; give 1 to 512");
  FLAME_CHECK(p.clip_l && (p.family == "flux" || p.clip_g) && (p.family != "flux" || p.t5), kGenerate,
              "the ", p.family, " pipeline's text encoders were released (or never loaded); give prompt "
              "embeddings (GenerateOptions::encode) or keep the encoders");
  if (p.tokenizer_t5 && p.tokenizer_t5->options().max_length != max_sequence_length) {
    T5TokenizerOptions to = p.tokenizer_t5->options();
    to.max_length = max_sequence_length;
    p.tokenizer_t5 = T5Tokenizer::from_folder(
        (fs::path(p.path) / (p.family == "flux" ? "tokenizer_2" : "tokenizer_3")).string(), to);
  }
  if (p.family == "flux") {
    // FLUX's CLIPTextModel: the pooled output, even when a single file brings a text_projection.
    const ClipEmbeds clip = encode_clip(*p.clip_l, *p.tokenizer_l, texts, p.device, false);
    return {encode_t5(*p.t5, *p.tokenizer_t5, texts, p.device), clip.pooled};
  }
  const ClipEmbeds l = encode_clip(*p.clip_l, *p.tokenizer_l, texts, p.device);
  const ClipEmbeds g = encode_clip(*p.clip_g, *p.tokenizer_g, texts, p.device);
  Tensor clip = flame::cat({l.penultimate, g.penultimate}, -1);
  if (p.family == "sdxl") return {clip, g.pooled};
  // SD3: [B, L + T, joint_dim] and pooled [B, proj_l + proj_g].
  const int64_t joint = p.sd3->config().joint_attention_dim;
  Tensor t5 = p.t5 ? encode_t5(*p.t5, *p.tokenizer_t5, texts, p.device)
                   : Tensor::zeros({static_cast<int64_t>(texts.size()), max_sequence_length, joint},
                                   {clip.dtype(), p.device});
  const int64_t pad = t5.size(-1) - clip.size(-1);
  FLAME_CHECK(pad >= 0, kGenerate, "SD3: the CLIP states' width ", clip.size(-1), " exceeds T5's ", t5.size(-1));
  if (pad > 0) clip = flame::pad(clip, {0, pad});
  return {flame::cat({clip, t5.to(clip.dtype())}, 1), flame::cat({l.pooled, g.pooled}, -1)};
}

Tensor generate(Pipeline& p, const GenerateOptions& options) {
  flame::NoGradGuard no_grad;
  GenerateOptions o = resolve_generate_options(p, options);
  const Encode encode = o.encode ? o.encode : Encode([&p, &o](const std::vector<std::string>& texts) {
    return encode_prompts(p, texts, o.max_sequence_length);
  });
  const int64_t f = p.vae->config().downscale();
  const int64_t n = static_cast<int64_t>(o.prompts.size()) * o.images_per_prompt;
  const int64_t h = o.height / f, w = o.width / f, c = latent_channels(p);
  flame::Generator gen(o.seed);
  Tensor latents = o.latents.defined() ? o.latents.to(p.device)
                                       : Tensor::randn({n, c, h, w}, 0.0, 1.0, {DType::f32, p.device}, &gen);
  latents = latents.to(p.dtype);
  const bool cfg = p.family != "flux" && o.guidance > 1.0;

  if (p.family == "flux") {
    const Conditioning cond = flux_conditioning(encode, o);
    const bool true_cfg = o.true_cfg_scale > 1.0;
    const Conditioning neg = true_cfg ? flux_conditioning(encode, o, true) : Conditioning{};
    FLAME_CHECK(!true_cfg || neg.states.sizes() == cond.states.sizes(), kGenerate,
                "the negative prompt's embeddings ", neg.states.sizes(), " differ in shape from the prompts' ",
                cond.states.sizes(), " (both are padded to max_sequence_length)");
    FlowMatchEulerDiscreteScheduler s(*p.flow_config);
    Tensor x = pack_latents(latents);
    s.set_flux_timesteps(o.steps, x.size(1));
    const Tensor img_ids = flux_img_ids(h, w, p.device), txt_ids = flux_txt_ids(cond.states.size(1), p.device);
    const Tensor guidance = p.flux->config().guidance_embeds
                                ? Tensor::full({n}, o.guidance, {DType::f32, p.device})
                                : Tensor();
    for (int64_t i = 0; i < s.num_steps(); ++i) {
      const Tensor t = Tensor::full({n}, s.timesteps()[i], {DType::f32, p.device}).to(x.dtype()) / 1000.0;
      Tensor v = p.flux->forward(x, cond.states, cond.pooled, t, img_ids, txt_ids, guidance);
      if (true_cfg) {  // diffusers: a second pass on the negative prompt, then neg + scale * (cond - neg)
        const Tensor vn = p.flux->forward(x, neg.states, neg.pooled, t, img_ids, txt_ids, guidance);
        v = vn + (v - vn) * o.true_cfg_scale;
      }
      x = s.step(v, x);
      if (o.on_step) o.on_step(i + 1, s.num_steps());
    }
    latents = unpack_latents(x, h, w);
  } else if (p.family == "sd3") {
    const Conditioning cond = sd3_conditioning(encode, o, cfg);
    FlowMatchEulerDiscreteScheduler s(*p.flow_config);
    FLAME_CHECK(!p.flow_config->use_dynamic_shifting, kGenerate,
                "SD3 with a dynamically shifted scheduler is not supported (SD3 and SD3.5 ship a fixed shift)");
    s.set_timesteps(o.steps);
    for (int64_t i = 0; i < s.num_steps(); ++i) {
      const Tensor in = cfg ? flame::cat({latents, latents}, 0) : latents;
      const Tensor t = Tensor::full({in.size(0)}, s.timesteps()[i], {DType::f32, p.device});
      Tensor v = p.sd3->forward(in, cond.states, cond.pooled, t);
      if (cfg) v = guide(v, o.guidance);
      latents = s.step(v, latents);
      if (o.on_step) o.on_step(i + 1, s.num_steps());
    }
  } else {
    const Conditioning cond = sdxl_conditioning(p, encode, o, cfg);
    std::unique_ptr<Scheduler> s = make_discrete_scheduler(o.sampler, *p.discrete_config);
    s->set_timesteps(o.steps);
    latents = latents * static_cast<float>(s->init_noise_sigma());
    for (int64_t i = 0; i < s->num_steps(); ++i) {
      const Tensor in = s->scale_model_input(cfg ? flame::cat({latents, latents}, 0) : latents);
      const Tensor t = Tensor::scalar(s->timesteps()[i], {DType::f32, p.device});
      Tensor eps = p.unet->forward(in, t, cond.states, {.text_embeds = cond.pooled, .time_ids = cond.time_ids});
      if (cfg) eps = guide(eps, o.guidance);
      const Tensor noise =
          s->needs_noise() ? Tensor::randn(latents.sizes(), 0.0, 1.0, {DType::f32, p.device}, &gen) : Tensor();
      latents = s->step(eps, latents, noise);
      if (o.on_step) o.on_step(i + 1, s->num_steps());
    }
  }
  const bool tiled = o.tiled_decode || std::max(o.width, o.height) > 2048;
  const Tensor image = tiled ? p.vae->tiled_decode(p.vae->from_latent(latents)) : p.vae->decode_latent(latents);
  return (image.to(DType::f32).to(Device::cpu()) / 2.0 + 0.5).clamp(0.0, 1.0);
}

}  // namespace flame_diffusion::models
