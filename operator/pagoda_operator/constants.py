"""Names shared by the CRD, the operator and the objects it creates."""

GROUP = "pagoda.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"

OPERATOR_NAME = "pagoda-operator"
FIELD_MANAGER = OPERATOR_NAME

# Labels on everything the operator creates; the first two form the pod selector.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/llmdeployment"
ENGINE_APP_NAME = "pagoda-engine"

# Hash of the desired object, stored on the object itself: a changed hash is a changed spec.
ANNOTATION_CONFIG_HASH = f"{GROUP}/config-hash"

# The engine's side of seam 1: its port and probe paths.
ENGINE_PORT = 8000
ENGINE_PORT_NAME = "http"
HEALTH_PATH = "/health"
READY_PATH = "/ready"
METRICS_PATH = "/metrics"
MODEL_MOUNT_PATH = "/models"
# The engine's writable places (its root filesystem is read-only): the engine images point
# every cache (XDG, Hugging Face, Triton, CUDA, torch inductor, pagoda's own) under the first.
ENGINE_CACHE_PATH = "/home/pagoda/.cache"
# The engine image's TRITON_CACHE_DIR; mounted from the model cache volume where there is one.
KERNEL_CACHE_PATH = f"{ENGINE_CACHE_PATH}/triton"
ENGINE_TMP_PATH = "/tmp"
EMBEDDED_MODEL = "default"

GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_ENGINE_IMAGE = "ghcr.io/pagoda-dev/pagoda-engine:0.1.0"
ENGINE_IMAGE_ENV = "PAGODA_ENGINE_IMAGE"
# The Gateway API inference extension's endpoint picker (spec.routing.gateway), pinned.
DEFAULT_PICKER_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.3.0"
PICKER_IMAGE_ENV = "PAGODA_ENDPOINT_PICKER_IMAGE"
ENGINE_USER_ID = 1000
# "false" when the Helm chart's own ServiceMonitor already scrapes every engine.
SERVICE_MONITORS_ENV = "PAGODA_SERVICE_MONITORS"
# Labels (a JSON object) and scrape interval of the per-LLMDeployment ServiceMonitors: the
# labels a Prometheus selects ServiceMonitors by (`release: kube-prometheus-stack`, say).
SERVICE_MONITOR_LABELS_ENV = "PAGODA_SERVICE_MONITOR_LABELS"
SERVICE_MONITOR_INTERVAL_ENV = "PAGODA_SERVICE_MONITOR_INTERVAL"
DEFAULT_SCRAPE_INTERVAL = "15s"
