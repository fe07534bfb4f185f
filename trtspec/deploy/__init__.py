"""What writes a deployment: the Triton model repository (`writer`, from `templates/`) and its checks (`checks`), the
Kubernetes manifests (`k8s`), the Prometheus rules and Grafana dashboard (`monitoring`), and the command lines that
start Triton on one or several GPUs (`launch`)."""
