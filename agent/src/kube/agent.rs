pub struct KubeAgent;
